"""``step_fn(model, batch)`` on a kept pipeline: ``model`` stands for the whole pipeline on this batch.

No rank holds a pipeline's whole model, so ``step_fn`` cannot be handed one.
What a step does with the model is almost always one forward on the batch's
inputs and something on its outputs (an argmax, a softmax, a dict with the
targets), as Lightning's ``predict_step`` does with ``self(x)``. So the
pipeline runs the batch through its stages first, on every rank of the
copy, and the last stage calls ``step_fn`` with a stand-in whose call on
the batch's inputs returns those outputs: the same ``step_fn`` works for a
kept pipeline and for a whole model. What only a whole model can do (a
forward on other inputs, its layers or attributes) is refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nbddp.worker.inference.parallel_forward import inputs_of

FIX = ("step_fn's model stands for the whole pipeline on this batch: call it once on the batch's own inputs "
       "(model(x) for an (x, y) batch) and work on what it returns. For other inputs or the model's parts, fit with "
       "return_weights=True and predict with the notebook's model")


class PipelineStepError(TypeError):
    """``step_fn`` asked a kept pipeline's stand-in for what only a whole model can give."""


class PipelineOutputs:
    """The stand-in for the model: called on the batch's inputs, the pipeline's outputs for them."""

    def __init__(self, outputs: Any, inputs: tuple[torch.Tensor, ...]):
        self._outputs, self._inputs = outputs, inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != len(self._inputs) or not all(map(same, args, self._inputs)):
            got = ", ".join([*(describe(a) for a in args), *(f"{k}=..." for k in kwargs)])
            raise PipelineStepError(f"a kept pipeline's step_fn called model({got}), not on the batch's inputs "
                                    f"({', '.join(map(describe, self._inputs))}). {FIX}")
        return self._outputs

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"a kept pipeline's step_fn asked for model.{name}: no rank holds the whole model. {FIX}")


def same(a: Any, b: torch.Tensor) -> bool:
    """``a`` is the input ``b`` (the very tensor, or one equal to it)."""
    return a is b or (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def stepped(run: Callable[[Any], Any], step_fn: Callable) -> Callable[[Any], Any]:
    """``batch -> step_fn(stand-in, batch)`` on the rank that holds the outputs; None on the other stages."""
    def forward(batch: Any) -> Any:
        out = run(batch)  # every stage takes part; only the last gets outputs
        return None if out is None else step_fn(PipelineOutputs(out, inputs_of(batch)), batch)

    return forward

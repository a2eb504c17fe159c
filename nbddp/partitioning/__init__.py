"""How a model is cut, the same in the kernel (checked before a fit) and on the workers (applied).

FSDP's units (``blocks.py``), a pipeline's stages (``pipeline_stages.py``)
and tensor-parallel plans (``tensor_plan.py``). Part of the shared layer:
imports torch and ``protocol/``, nothing else of nbddp.
"""

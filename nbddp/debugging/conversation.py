"""The debugger conversation in the notebook: pdb's lines from the ranks, the person's commands back.

One ``Conversation`` talks to every rank now in pdb (``rank_lines.py``'s ``RankLine``:
paused at ``breakpoint()``, or in a post-mortem). With one rank it attaches
at once; with several it lists them first and takes, besides pdb's own
commands on the attached rank (``p``, ``pp``, ``l``, ``ll``, ``w``, ``u``,
``d``, ``n``, ``s``, ``c``, ``q``, any expression):

==========================  ===============================================
``list``                     the ranks in the debugger (at the rank prompt:
                             pdb's ``list``)
``attach R``                 talk to rank R
``detach``                   leave this rank as it is (paused)
``cast ranks(0,1) CMD``      one command on several ranks (``ranks(0:4)``,
                             ``cast CMD``: all of them)
``continue all`` (``c all``)  resume every paused rank
``help nbddp``               this table
==========================  ===============================================

Lines come from a ``reader``: the notebook's own input box (``input()``,
which ipykernel turns into an input request, so it works in JupyterLab,
Notebook 7 and VS Code), or a list of commands (``nbddp.debug(commands=...)``).
Everything shown is also kept as the transcript.
"""

from __future__ import annotations

import re
import sys
from typing import IO, Any, Iterable, Protocol

from nbddp.debugging.rank_lines import DebugBoard, RankLine
from nbddp.protocol.errors import NbddpError

HELP = ("nbddp debugger: pdb's commands (p, pp, l, ll, w, u, d, n, s, any expression) go to the attached rank; "
        "c resumes it, q quits (its work ends with an error). Also: list, attach R, detach, "
        "cast ranks(0,1) CMD, continue all.\n")
_CAST = re.compile(r"^cast\s+(?:ranks\(([^)]*)\)\s*)?(.+)$")
_CONTINUE = ("c", "cont", "continue")
_QUIT = ("q", "quit", "exit")
CLIENT_SENDS_NO_INPUT = "the notebook's client sends no input (allow_stdin is off, as in nbclient)"


class NoPrompt(NbddpError):
    """No person can type here (no stdin: nbclient without ``allow_stdin``, a script without a terminal)."""


class Reader(Protocol):
    """Where the person's lines come from: ``Interactive`` (typed) or ``Scripted`` (given); None: no more."""

    def read(self, prompt: str) -> str | None: ...


class Interactive:
    """Lines typed by the person: the kernel's stdin (the notebook's input box) or a terminal."""

    def check(self) -> None:
        """Raise ``NoPrompt`` now if no line could ever be read (before anything is shown)."""
        kernel = _kernel()
        if kernel is None and (sys.stdin is None or not _isatty(sys.stdin)):
            raise NoPrompt("stdin is not a terminal")
        if kernel is not None and getattr(kernel, "_allow_stdin", True) is False:
            raise NoPrompt(CLIENT_SENDS_NO_INPUT)

    def read(self, prompt: str) -> str:
        self.check()
        try:
            return input(prompt)
        except EOFError:
            raise NoPrompt("stdin was closed (end of file)") from None
        except Exception as exc:  # ipykernel's StdinNotImplementedError: the client sends no input
            if type(exc).__name__ == "StdinNotImplementedError":
                raise NoPrompt(CLIENT_SENDS_NO_INPUT) from None
            raise


class Scripted:
    """Lines given in advance (``commands=[...]``); None once they are used up."""

    def __init__(self, commands: Iterable[str]):
        self.lines = list(commands)

    def read(self, prompt: str) -> str | None:
        return self.lines.pop(0) if self.lines else None


def _kernel() -> Any:
    """The ipykernel kernel this runs in, or None (a terminal, a script)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def parse_ranks(text: str) -> list[int]:
    """``"0,1"`` -> [0, 1]; ``"0:3"`` -> [0, 1, 2]; mixed is fine."""
    ranks: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if ":" in part:
            a, b = part.split(":", 1)
            ranks.extend(range(int(a), int(b)))
        elif part:
            ranks.append(int(part))
    return sorted(set(ranks))


LEAVE = "leave"


class Conversation:
    """One debugging session over the board's ranks; ``text`` is its transcript."""

    def __init__(self, board: DebugBoard, reader: Reader, echo: bool, note: str = ""):
        """``note``: said once, after the help, when a rank is paused at a breakpoint."""
        self.board, self.reader, self.echo, self.note = board, reader, echo, note
        self.text: list[str] = []
        self._known: set[int] = set()
        self._helped = False

    # ---- what is shown, what is read ------------------------------------------------
    def say(self, text: str) -> None:
        if not text:
            return
        self.text.append(text)
        if self.echo:
            print(text, end="", flush=True)

    def ask(self, prompt: str) -> str | None:
        line = self.reader.read(prompt)
        if line is not None:
            self.text.append(f"{prompt}{line}\n")
        return line

    # ---- the loop ---------------------------------------------------------------------
    def run(self, only: int | None = None) -> None:
        """Until no rank is left in pdb, the commands run out, or the person detaches."""
        attached: RankLine | None = None
        while True:
            lines = [ln for ln in self.board.poll() if only is None or ln.rank == only]
            if attached is not None and (attached.ended or attached not in lines):
                self._ended(attached)
                attached = None
            if not lines:
                return
            self._announce(lines, attached)
            if attached is None and len(lines) == 1:
                attached = lines[0]
            if attached is None:
                line = self.ask("(nbddp debug) ")
            elif not attached.wait_ask():  # it went on (c, q) or its task ended
                continue
            else:
                body, _, prompt = attached.take_output().rpartition("\n")
                self.say(body + "\n" if body else "")
                line = self.ask(f"[rank {attached.rank}] {prompt or '(Pdb) '}")
            if line is None:
                return
            chosen = self.step(line, lines, attached)
            if isinstance(chosen, str):  # LEAVE
                return
            attached = chosen

    def _ended(self, line: RankLine) -> None:
        self.say(line.take_output())
        self.say(f"nbddp: rank {line.rank}: {line.ended or 'left the debugger'}\n")

    def _announce(self, lines: list[RankLine], attached: RankLine | None) -> None:
        new = [ln for ln in lines if ln.rank not in self._known]
        self._known.update(ln.rank for ln in lines)
        if not new:
            return
        if len(lines) > 1 and attached is None:
            self.show_list(lines)
        else:
            self.say("".join(f"nbddp: {ln.describe()}\n" for ln in new))
        if not self._helped:
            self._helped = True
            self.say(HELP)
            if self.note and any(ln.kind == "breakpoint" for ln in lines):
                self.say(self.note)

    def show_list(self, lines: list[RankLine]) -> None:
        self.say("nbddp: ranks in the debugger (attach R to talk to one):\n"
                 + "".join(f"  {ln.describe()}\n" for ln in lines))

    def step(self, line: str, lines: list[RankLine], attached: RankLine | None) -> RankLine | str | None:
        """nbddp's own commands; anything else goes to the attached rank. Returns who is attached next (``LEAVE``:
        the person left)."""
        word = line.strip()
        by_rank = {ln.rank: ln for ln in lines}
        if word == "help nbddp" or (attached is None and word == "help"):
            self.say(HELP)
        elif word == "attach" or word.startswith("attach "):
            return self._attach(word, by_rank, attached)
        elif word == "detach":
            return None if len(lines) > 1 and attached is not None else LEAVE
        elif word.startswith("cast "):
            self.cast(word, by_rank)
        elif word in ("continue all", "c all") or (attached is None and word in _CONTINUE + _QUIT):
            for ln in lines:
                self.send_and_show(ln, "q" if word in _QUIT else "c", labelled=len(lines) > 1)
            return None
        elif attached is not None:
            attached.send_line(line)
        elif word in ("", "list"):
            self.show_list(lines)
        else:
            self.say(f"nbddp: no rank attached: attach R first (ranks in the debugger: {_ranks(lines)}), "
                     "or cast CMD for all of them\n")
        return attached

    def _attach(self, word: str, by_rank: dict[int, RankLine], attached: RankLine | None) -> RankLine | None:
        parts = word.split()
        if len(parts) == 2 and parts[1].isdigit() and int(parts[1]) in by_rank:
            return by_rank[int(parts[1])]
        self.say(f"nbddp: attach R takes a rank in the debugger: {_ranks(list(by_rank.values()))}\n")
        return attached

    def cast(self, word: str, by_rank: dict[int, RankLine]) -> None:
        match = _CAST.match(word)
        try:
            ranks = parse_ranks(match.group(1)) if match and match.group(1) is not None else sorted(by_rank)
        except ValueError:
            ranks = None
        if match is None or ranks is None:
            self.say("nbddp: cast ranks(0,1) CMD runs CMD on those ranks (ranks(0:4) for a range); "
                     "cast CMD on all of them\n")
            return
        for rank in ranks:
            if rank in by_rank:
                self.send_and_show(by_rank[rank], match.group(2), labelled=True)
            else:
                self.say(f"[rank {rank}] not in the debugger\n")

    def send_and_show(self, ln: RankLine, command: str, labelled: bool = False) -> None:
        """``command`` on one rank, its answer shown (labelled by rank)."""
        if not ln.wait_ask():
            return
        ln.take_output()  # what it showed before asking was shown already
        ln.send_line(command)
        ln.wait_ask()
        text = ln.take_output().rpartition("\n")[0].strip("\n") if not ln.ended else ln.take_output().strip("\n")
        if ln.ended:
            text = "\n".join(t for t in (text, ln.ended if labelled else f"nbddp: rank {ln.rank}: {ln.ended}") if t)
        if labelled:
            text = "\n".join(f"[rank {ln.rank}] {t}" for t in text.splitlines())
        self.say(text + "\n" if text else "")


def _ranks(lines: list[RankLine]) -> str:
    return ", ".join(str(ln.rank) for ln in lines) or "none"

"""``nbddp.debug`` and ``%ddp debug``: the kernel's end of pdb on a rank.

Owns the commands (``commands.py``), the prompt in a waiting cell
(``prompt.py``), the conversation with paused ranks, and each rank's line
(``rank_lines.py``). Never imports ``session/``: the public face hands it
the session. Sends only ``worker/tasks/debugging.py``.
"""

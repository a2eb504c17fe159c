"""How the kernel runs work on the ranks: the one package that sends tasks, watches them and decides what happened.

Every task the kernel sends to an engine goes through ``send.py``; one task
per rank is watched by ``rank_tasks.RankTasks`` (results, or a fast, named
failure); ``outcome.py`` is the one module that decides what became of a
rank (finished, raised, died with a signal, stuck in a collective, failed
as a consequence of a peer) and which failure is the headline;
``stalls.py`` sees ranks that stopped advancing and kills stuck peers after
one grace period; ``policy.py`` holds the one failure policy
(``max_restarts``, ``retry_on``, ``min_workers``, ``stall_timeout``, the
grace); ``work.py`` is the base every kind of work on the ranks implements
(a fit, a prediction, a cell or call, a sweep and its trials) and how a cell
waits for it. ``contracts.py`` says what this package needs of the session.

The package imports only the shared layer: the session, the supervisor that
heals and the debugger reach it as the objects ``contracts.py`` describes.
"""

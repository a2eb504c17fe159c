"""Planning before a long fit: ``find_batch_size`` and ``scaling_report``.

Short trial steps on the warm workers; sends ``worker/tasks/trials.py``.
"""

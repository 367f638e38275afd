"""The manager's queue: the scheduler pass, placement, fair share, backfill reservations, preemption, MIG, ETA, fragmentation."""

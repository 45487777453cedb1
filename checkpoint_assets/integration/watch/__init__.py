"""How assets are watched: the sensors, failed partitions, spend, pending provider batches, events
and global resume.
"""

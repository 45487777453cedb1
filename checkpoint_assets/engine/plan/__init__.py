"""The plan of a run: what is stored, what is reused and what is left to do.

``opening.py``: check the job, load the checkpoint, plan the rest; ``start.py``: the job and the
state of the checkpoint a run starts from, which ``opening.py`` and ``found.py`` share;
``found.py``: rows of other checkpoints and of the result store taken into the checkpoint;
``inputs.py``: a shard's input, read a slice at a time, hashed into its keys; ``resume.py``:
which rows are done; ``global_resume.py``: finished rows across an asset's checkpoints;
``function_fingerprint.py``: what counts as a change of the user's function.
"""

"""Provider batches: rows sent through a provider's batch API instead of calls to the function.

``submissions.py``: the protocol a provider's batch API meets (the resources implement it);
``submission_records.py``: what was submitted, stored next to the checkpoint;
``provider_batches.py``: the work loop that submits, polls and collects;
``job.py``: the job and its way (mode, deadline, waiting); ``splits.py``: the rows cut into
submissions, their estimated cost; ``handoff.py``: the rows a hybrid or online run finishes
online (``online.py``);
``answers.py``: the response bodies kept with the rows, parsed again when ``parse`` changed.
"""

"""The schedule program's steps, as data (no torch): what one step of a rank runs, per call of Megatron-Core's
driver. ``steps.py`` lays out a step's windows of ops (``replay.py``: full recompute's replay in them), ``ops.py``
declares the ops, ``pipeline.py`` the roles and phases, ``interpreter.py`` runs the ops in a lane's order."""

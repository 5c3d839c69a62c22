"""The schedule program: what a rank runs in a training step, as data (pure Python; no torch).

``steps.py`` yields the steps, ``pipeline.py`` orders them over pipeline ranks, ``ops.py`` declares every op,
``replay.py`` places full recompute, ``units.py`` splits microbatches, ``interpreter.py`` runs the ops.
"""

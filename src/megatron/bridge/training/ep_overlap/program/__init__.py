"""The schedule program: what a rank runs in a training step, as data (no torch). ``steps.py`` yields the steps,
``pipeline.py`` orders them over ranks, ``ops.py`` declares the ops, ``interpreter.py`` runs them."""

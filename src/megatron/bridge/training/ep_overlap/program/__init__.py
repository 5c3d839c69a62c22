"""The schedule program: what a rank runs in a training step, as data (pure Python; no torch).

``steps.py`` yields the steps and their windows of ops; ``pipeline.py`` orders microbatches over pipeline ranks;
``units.py`` says what one sequence of nodes runs; ``ops.py`` declares every op once; ``interpreter.py`` runs them
in the order the lane issues them. The engine executes the program, the planner prices it, Megatron-Core's driver
runs its per-kind steps.
"""

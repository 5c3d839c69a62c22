"""The whole-step schedule program, for the lab (the engine, the planner, the scripts and the tests): a rank's
training step as data, no torch. ``steps.py`` yields the steps (:func:`~ep_overlap_lab.program.steps.program`),
``pipeline.py`` orders them over pipeline ranks, ``units.py`` names the units, ``runners.py`` states what a runner of
the ops implements. Each step's windows are the payload's (``megatron.bridge.training.ep_overlap.program``)."""

"""Test-only: the recipe check's worker and stand-ins (``tools/recipe_check.py`` runs ``worker.py``)."""

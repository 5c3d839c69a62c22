"""Test-only: the recipe check's ``--json`` file, and ``--resume`` from it.

One JSON object: ``rows`` (one per config, each with its ``verdict``), ``partial`` (true when the run was interrupted:
``rows`` then holds only the configs finished), ``asked`` (the names or ``--all``, and ``--no_delay_wgrad``) and
``finished`` / ``of`` (configs). A run given ``--resume FILE`` keeps FILE's finished rows and runs only the rest.
"""

import json
from pathlib import Path

FORMAT = "recipe-check rows 1"


class BadRowsFile(ValueError):
    """A ``--resume`` file the check cannot take: the message is one line, with its fix."""


def unwritable(flag: str, path: Path) -> str | None:
    """Why ``path`` cannot be written (one line, with the fix), or None. Leaves no file behind."""
    if path.is_dir():
        return f"{flag} {path}: is a directory; fix: name a file"
    if not path.parent.is_dir():
        return f"{flag} {path}: the directory {path.parent} does not exist; fix: create it, or name another path"
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as error:
        return f"{flag} {path}: cannot be written ({error.strerror}); fix: name a writable path"
    if not existed:
        path.unlink()
    return None


def finished(row: dict) -> bool:
    return "verdict" in row


def write(path: Path, rows: list[dict], asked: dict, of: int | None, partial: bool) -> None:
    """``rows`` (only the finished ones when ``partial``) as the check's JSON file."""
    kept = [row for row in rows if finished(row)] if partial else rows
    blob = {"format": FORMAT, "partial": partial, "finished": len(kept), "of": of, "asked": asked, "rows": kept}
    path.write_text(json.dumps(blob, indent=1))


def load(path: Path, no_delay_wgrad: bool) -> tuple[dict[str, dict], dict]:
    """FILE's finished rows by recipe, and what its run was asked. Raises :class:`BadRowsFile`."""
    fix = "fix: name the --json file of an earlier run of this check, or run without --resume"
    try:
        blob = json.loads(path.read_text())
    except OSError as error:
        raise BadRowsFile(f"--resume {path}: cannot be read ({error.strerror}); {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRowsFile(f"--resume {path}: not JSON ({error}); {fix}") from None
    rows = blob.get("rows") if isinstance(blob, dict) and blob.get("format") == FORMAT else None
    if not isinstance(rows, list) or not all(isinstance(row, dict) and isinstance(row.get("recipe"), str)
                                             for row in rows):  # fmt: skip
        raise BadRowsFile(f"--resume {path}: not a rows file of this check ({FORMAT!r}); {fix}")
    asked = blob.get("asked") if isinstance(blob.get("asked"), dict) else {}
    if bool(asked.get("no_delay_wgrad")) != no_delay_wgrad:
        was = "with" if asked.get("no_delay_wgrad") else "without"
        raise BadRowsFile(f"--resume {path}: its rows were run {was} --no_delay_wgrad; fix: run {was} it too")
    return {row["recipe"]: row for row in rows if finished(row)}, asked

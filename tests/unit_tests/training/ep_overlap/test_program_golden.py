"""The schedule program of every option combination the rules allow, recorded in ``golden/programs_pp{1,2}.txt``.

The program is pure data, so it is recorded here in-process and without torch: for the reference shapes (3 layers
at PP 1; 4 layers at PP 2 x VPP 2, both pipeline ranks), every engine option set ``program_events.engine_options``
lists (the launch thread aside: it changes no op), as ``format_program`` writes it, one line per window; each
distinct program once, one file per pipeline size (each under 100 KB, to read in a diff). Any change to the order
fails here, naming the first line that differs. After a deliberate
change, rewrite it with ``EP_OVERLAP_WRITE_GOLDEN=1 pytest .../ep_overlap/test_program_golden.py`` and review the
diff. ``test_launch_order.py`` checks that the engine's real launches follow these programs.
"""

import hashlib
import os
from pathlib import Path

import pytest

from ep_overlap_lab.program.steps import format_program, program
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

from .program_events import engine_options, key, rank_chunks

LAYOUTS = {1: ([1, 0, 1], (1, 3)), 2: ([1, 0, 1, 1], (5,))}  # pipeline size: (moe_layer_freq, microbatch counts)
GOLDEN = {pp: Path(__file__).parent / "golden" / f"programs_pp{pp}.txt" for pp in LAYOUTS}


def _programs(pp: int) -> tuple[list[str], dict[str, str]]:
    """(``combination: digest`` lines, {digest: program text}) of one pipeline size."""
    lines, texts = [], {}
    freq, counts = LAYOUTS[pp]
    combos = {key({k: v for k, v in o.items() if k != "launch_off_host"}): o for o in engine_options(pp)}
    for combo, options in sorted(combos.items()):
        fields = {k: v for k, v in options.items() if k not in ("launch_off_host", "forward_only")}
        if fields.get("attention_wgrad_window", 1) is None:  # auto: placement runs window 1 or 2 (both here)
            continue
        for n in counts:
            for rank in range(pp):
                shapes, _ = rank_chunks(freq, pp, rank)
                steps = program(EPOverlapOptions(**fields), shapes, n, pipeline_size=pp, rank=rank,
                                forward_only=options["forward_only"])  # fmt: skip
                text = format_program(list(steps), rank, pp)
                digest = hashlib.sha256(text.encode()).hexdigest()[:12]
                texts[digest] = text
                lines.append(f"pp={pp} rank={rank} N={n} {combo}: {digest}")
    return lines, texts


def _render(lines: list[str], texts: dict[str, str]) -> str:
    out = ["# Written by test_program_golden.py (EP_OVERLAP_WRITE_GOLDEN=1); review its diff.", "", *lines, ""]
    for digest in sorted(texts):
        out += [f"## {digest}", texts[digest], ""]
    return "\n".join(out)


@pytest.mark.parametrize("pp", sorted(LAYOUTS))
def test_every_combinations_program_is_the_recorded_one(pp):
    lines, texts = _programs(pp)
    assert len(lines) > 20 and len(texts) > 5  # the combinations differ: they are not one program
    rendered = _render(lines, texts)
    if os.environ.get("EP_OVERLAP_WRITE_GOLDEN") == "1":
        GOLDEN[pp].write_text(rendered)
        return
    assert len(rendered.encode()) < 100_000, "the golden file grew past 100 KB: split it further"
    recorded_lines, recorded_texts = _parse(GOLDEN[pp].read_text())
    for line, was in zip(lines, recorded_lines):
        combination, digest = line.rsplit(": ", 1)
        recorded_combination, recorded_digest = was.rsplit(": ", 1)
        assert combination == recorded_combination, f"combination {combination!r}, recorded {recorded_combination!r}"
        if digest != recorded_digest:
            now, then = texts[digest].splitlines(), recorded_texts[recorded_digest].splitlines()
            i = next((i for i, (a, b) in enumerate(zip(now, then)) if a != b), min(len(now), len(then)))
            have, had = (seq[i] if i < len(seq) else "<end>" for seq in (now, then))
            pytest.fail(f"{combination}: program line {i + 1} is now {have!r}, recorded {had!r}")
    assert len(lines) == len(recorded_lines), "a combination was added or removed"
    assert rendered == GOLDEN[pp].read_text(), f"{GOLDEN[pp].name} is not as written (rewrite it)"


def _parse(text: str) -> tuple[list[str], dict[str, str]]:
    lines, texts, current = [], {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:]
            texts[current] = []
        elif current is not None:
            texts[current].append(line)
        elif line.startswith("pp="):
            lines.append(line)
    return lines, {digest: "\n".join(body).rstrip("\n") for digest, body in texts.items()}

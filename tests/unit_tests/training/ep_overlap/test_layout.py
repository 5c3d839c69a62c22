"""The layout shows the roles: the program and the planner need no torch, the engine knows no model, the reference
model knows only the contract, one program has three consumers, and no file grows past 500 lines."""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
EP_OVERLAP = ROOT / "src/megatron/bridge/training/ep_overlap"
MODEL = ROOT / "src/megatron/bridge/models/moe_gpt"
# What needs no torch: the program, the planner, and what they import.
TORCH_FREE = (
    "program", "planner", "options.py", "contract.py", "intervals.py", "segments.py", "settings.py",
    "storage_count.py",
)  # fmt: skip


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]


def _files(*parts: str) -> list[Path]:
    paths = [EP_OVERLAP / part for part in parts]
    return sorted(p for path in paths for p in ([path] if path.is_file() else path.glob("*.py")))


def test_the_planner_and_the_program_load_no_torch():
    code = (
        "import sys\n"
        "import megatron.bridge.training.ep_overlap.planner, megatron.bridge.training.ep_overlap.program\n"
        "import megatron.bridge.training.ep_overlap.planner.cost_model\n"
        "from megatron.bridge.training.ep_overlap import EPOverlapOptions\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(loaded or 'none')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "none"


def test_the_planner_cli_runs_where_torch_cannot_be_imported():
    script = ROOT / "scripts/performance/ep_overlap_plan.py"
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        f"sys.argv = [{str(script)!r}, '--model', 'qwen3-30b-a3b', '--gpus', '16', '--ep', '16']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "speedup" in run.stdout and "best of" in run.stdout


@pytest.mark.parametrize("path", _files(*TORCH_FREE), ids=lambda p: str(p.relative_to(EP_OVERLAP)))
def test_torch_free_modules_import_nothing_that_needs_torch(path):
    ours = [m for m in _imports(path) if m and m.startswith("megatron.bridge.training.ep_overlap")]
    allowed = tuple(f"megatron.bridge.training.ep_overlap.{part.removesuffix('.py')}" for part in TORCH_FREE)
    assert not any(m == "torch" or m.startswith("torch.") for m in _imports(path))
    assert all(m.startswith(allowed) for m in ours), ours


@pytest.mark.parametrize("path", _files("engine", "program", "contract.py", "options.py"), ids=lambda p: p.name)
def test_the_engine_imports_no_model_no_adapter_and_no_planner(path):
    bad = [m for m in _imports(path) if m and (".models" in m or ".ep_overlap.mcore" in m or ".planner" in m)]
    assert not bad, f"{path.name} imports {bad}"


# What the reference model may import of ours: the contract, and the auxiliary-loss scales of an engine step.
MODEL_MAY_IMPORT = (
    "megatron.bridge.training.ep_overlap.contract",
    "megatron.bridge.training.ep_overlap.loss_scales",
    "megatron.bridge.training.ep_overlap.segments",  # which layers full recompute replays: the model's plain path too
    "megatron.bridge.training.ep_overlap.settings",  # the resolved options and rules, as every consumer reads them
)


@pytest.mark.parametrize("path", sorted(MODEL.glob("*.py")), ids=lambda p: p.name)
def test_the_reference_model_imports_the_contract_not_the_engine(path):
    ours = [m for m in _imports(path) if m and m.startswith("megatron.bridge.training.ep_overlap")]
    assert all(m in MODEL_MAY_IMPORT for m in ours), ours


def test_building_and_running_the_reference_model_loads_no_engine_module():
    code = (
        "import sys, torch\n"
        "from megatron.bridge.models.moe_gpt import MoEGPTConfig, MoEGPTModel\n"
        "config = MoEGPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, seq_length=4,\n"
        "                      vocab_size=32, add_bias_linear=False, moe_z_loss_coeff=0.1)\n"
        "tokens = torch.zeros(1, 4, dtype=torch.long)\n"
        "MoEGPTModel(config)(tokens, tokens, 4.0).backward()\n"
        "print(sorted(m for m in sys.modules if '.ep_overlap.' in m and m.split('.ep_overlap.')[1].split('.')[0]\n"
        "             in ('engine', 'planner', 'program', 'mcore', 'placement')) or 'none')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "none"


def test_no_function_of_the_program_engine_or_planner_is_over_60_lines():
    long = {
        f"{path.relative_to(EP_OVERLAP)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in _files("program", "engine", "planner")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    }
    assert not long, long


def test_the_roles_are_spelled_once():
    # Forward and backward are program.pipeline.Role members; a bare "F" or "B" would be a second spelling.
    literals = [
        f"{path.relative_to(EP_OVERLAP)}:{node.lineno}"
        for path in EP_OVERLAP.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ("F", "B") and path.name != "pipeline.py"
    ]
    assert not literals, literals


def test_no_file_of_the_engine_planner_adapter_or_reference_model_is_over_500_lines():
    paths = list(EP_OVERLAP.rglob("*.py")) + list(MODEL.glob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def _names(path: Path) -> set[str]:
    """Identifiers used in the code (not in strings or comments)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {token.string for token in tokens if token.type == tokenize.NAME}


def test_the_variants_are_inputs_of_the_generator_only():
    # Edge pairing and chunking live in the program (and the options object and the rules table): no consumer
    # branches on them, and the engine's driver dispatches on no node type.
    variants = {"edge_pairing", "moe_ep_overlap_chunks"}
    users = {str(p.relative_to(EP_OVERLAP)) for p in EP_OVERLAP.rglob("*.py") if variants & _names(p)}
    assert "program/steps.py" in users and {u for u in users if not u.startswith("program/")} == {"options.py"}, users
    driver = ast.parse((EP_OVERLAP / "engine/driver.py").read_text())
    checked = [
        ast.unparse(node.args[1])
        for node in ast.walk(driver)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
    ]
    assert set(checked) <= {"list | tuple"}, checked  # a model or a list of chunks; never a kind of node

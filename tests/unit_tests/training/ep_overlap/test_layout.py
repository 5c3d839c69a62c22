"""The layout shows the roles: the payload (``megatron.bridge``) imports nothing of the lab (``ep_overlap_lab``), the
program and the planner need no torch, the engine knows no model, the reference model knows only the contract, one
program has three consumers, and no file grows past 500 lines."""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
PAYLOAD = ROOT / "src/megatron/bridge"
EP_OVERLAP = PAYLOAD / "training/ep_overlap"
LAB = ROOT / "src/ep_overlap_lab"
MODEL = LAB / "moe_gpt"
# What needs no torch: the program, the planner, and what they import.
TORCH_FREE = (
    EP_OVERLAP / "program", LAB / "program", LAB / "planner", EP_OVERLAP / "options.py", EP_OVERLAP / "contract.py",
    EP_OVERLAP / "settings.py", LAB / "storage_count.py", LAB / "pipeline_layout.py",
    LAB / "step_stats.py",
)  # fmt: skip
TORCH_FREE_MODULES = tuple(
    ".".join(path.relative_to(ROOT / "src").with_suffix("").parts) if path.suffix else
    ".".join(path.relative_to(ROOT / "src").parts)
    for path in TORCH_FREE
)  # fmt: skip


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]


def _files(*paths: Path) -> list[Path]:
    return sorted(p for path in paths for p in ([path] if path.is_file() else path.glob("*.py")))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT / "src"))


@pytest.mark.parametrize("path", sorted(PAYLOAD.rglob("*.py")), ids=_shown)
def test_the_payload_imports_nothing_of_the_lab(path):
    # What a Bridge training step calls is the patch; the lab stays out of it, so nothing of it may be reached.
    lab = [m for m in _imports(path) if m and m.split(".")[0] == "ep_overlap_lab"]
    assert not lab, f"{_shown(path)} imports {lab}"


def test_the_planner_and_the_program_load_no_torch():
    code = (
        "import sys\n"
        "import ep_overlap_lab.planner, ep_overlap_lab.program.steps, megatron.bridge.training.ep_overlap.program\n"
        "import ep_overlap_lab.planner.cost_model\n"
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


@pytest.mark.parametrize("path", _files(*TORCH_FREE), ids=_shown)
def test_torch_free_modules_import_nothing_that_needs_torch(path):
    ours = [m for m in _imports(path) if m and m.startswith(("megatron.bridge.training.ep_overlap", "ep_overlap_lab"))]
    assert not any(m == "torch" or m.startswith("torch.") for m in _imports(path))
    assert all(m.startswith(TORCH_FREE_MODULES) for m in ours), ours


_ENGINE = (LAB / "engine", EP_OVERLAP / "runtime", EP_OVERLAP / "program", LAB / "program",
           EP_OVERLAP / "contract.py", EP_OVERLAP / "options.py")  # fmt: skip


# The one engine module that knows the adapter: what Megatron-Core's driver and finalize_model_grads do around a
# step of a Megatron-Core plan, which the engine must do itself when it runs one (kept out of the payload).
ENGINE_MAY_IMPORT_THE_ADAPTER = {"step_hooks.py"}


@pytest.mark.parametrize("path", _files(*_ENGINE), ids=_shown)
def test_the_engine_imports_no_model_no_adapter_and_no_planner(path):
    adapter = () if path.name in ENGINE_MAY_IMPORT_THE_ADAPTER else (".ep_overlap.mcore",)
    bad = [m for m in _imports(path) if m and any(part in m for part in (".moe_gpt", ".planner", *adapter))]
    assert not bad, f"{path.name} imports {bad}"


# What the reference model may import of ours: the contract, and its side of an engine step (hooks, loss scales).
MODEL_MAY_IMPORT = (
    "megatron.bridge.training.ep_overlap.contract",
    "ep_overlap_lab.step_loss",
    "ep_overlap_lab.wgrad_store",  # the FIFO its delayable linears keep deferred wgrads in
    "megatron.bridge.training.ep_overlap.settings",  # the resolved options and rules, as every consumer reads them
)


@pytest.mark.parametrize("path", sorted(MODEL.glob("*.py")), ids=lambda p: p.name)
def test_the_reference_model_imports_the_contract_not_the_engine(path):
    ours = [m for m in _imports(path) if m and m.startswith("megatron.bridge.training.ep_overlap")]
    assert all(m in MODEL_MAY_IMPORT for m in ours), ours


def test_building_and_running_the_reference_model_loads_no_engine_module():
    code = (
        "import sys, torch\n"
        "from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel\n"
        "config = MoEGPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, seq_length=4,\n"
        "                      vocab_size=32, add_bias_linear=False, moe_z_loss_coeff=0.1)\n"
        "tokens = torch.zeros(1, 4, dtype=torch.long)\n"
        "MoEGPTModel(config)(tokens, tokens, 4.0).backward()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('ep_overlap_lab.engine', 'ep_overlap_lab.planner',\n"
        "             'ep_overlap_lab.placement', 'ep_overlap_lab.program')) or\n"
        "             m.split('.ep_overlap.')[-1].split('.')[0] in\n"
        "             ('program', 'mcore', 'runtime')) or 'none')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "none"


def test_no_function_of_the_program_engine_or_planner_is_over_60_lines():
    long = {
        f"{_shown(path)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in _files(
            EP_OVERLAP / "program", EP_OVERLAP / "runtime", LAB / "program", LAB / "engine", LAB / "planner"
        )
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    }
    assert not long, long


def test_the_roles_are_spelled_once():
    # Forward and backward are program.pipeline.Role members; a bare "F" or "B" would be a second spelling.
    literals = [
        f"{_shown(path)}:{node.lineno}"
        for path in [*EP_OVERLAP.rglob("*.py"), *LAB.rglob("*.py")]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ("F", "B") and path.name != "pipeline.py"
    ]
    assert not literals, literals


def test_no_file_of_the_engine_planner_adapter_or_reference_model_is_over_500_lines():
    paths = list(EP_OVERLAP.rglob("*.py")) + list(LAB.rglob("*.py"))
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
    users = {_shown(p) for p in [*EP_OVERLAP.rglob("*.py"), *LAB.rglob("*.py")] if variants & _names(p)}
    program = ("ep_overlap_lab/program/", "megatron/bridge/training/ep_overlap/program/")  # the lab's, the payload's
    assert "ep_overlap_lab/program/steps.py" in users, users
    assert {u for u in users if not u.startswith(program)} == {"megatron/bridge/training/ep_overlap/options.py"}, users
    driver = ast.parse((LAB / "engine/driver.py").read_text())
    checked = [
        ast.unparse(node.args[1])
        for node in ast.walk(driver)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
    ]
    assert set(checked) <= {"list | tuple"}, checked  # a model or a list of chunks; never a kind of node

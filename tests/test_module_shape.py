"""The package's shape: state is passed in, never set on a layer's shard from outside; no import
circles behind function-level imports; the report's replay runs without DeepSpeed."""
import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed  # fresh interpreters in subprocesses

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_fssdp"

# A shard and the parts it owns: the attributes each sets on itself belong to it alone.
OWNERS = {"moe/sharded.py": "ShardedExperts", "moe/replicas.py": "ReplicaManager", "moe/timing.py": "LayerTimings",
          "moe/dispatcher.py": "TokenDispatcher"}
# Names that other objects (autograd contexts, the replay's settings) have too: an assignment to one
# elsewhere is not a shard's.
SHARED_NAMES = {"spec", "group", "world", "exchange", "rematerialize", "ranks_per_node"}
# The prefetch chain's links, set by sharded.chain when the stage builds its layers.
CHAIN = ("moe/sharded.py", "chain")


def _targets(node):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for t in targets:
        yield from (t.elts if isinstance(t, ast.Tuple) else [t])


def owned_names() -> set:
    names = set()
    for path, cls in OWNERS.items():
        for node in ast.walk(ast.parse((PACKAGE / path).read_text())):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for n in ast.walk(node):
                    if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                        names.update(t.attr for t in _targets(n) if isinstance(t, ast.Attribute)
                                     and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names - SHARED_NAMES


def set_from_outside(source: str, names: set, *, skip_function: str | None = None) -> list:
    """``(line, target)`` of every assignment to one of ``names`` on an object other than ``self``."""
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == skip_function:
            skipped.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and id(node) not in skipped:
            found += [(node.lineno, ast.unparse(t)) for t in _targets(node) if isinstance(t, ast.Attribute)
                      and t.attr in names and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    return found


def test_the_scan_finds_state_set_from_afar():
    """Negative control: the assignments the stage and the HF experts once made are found."""
    names = owned_names()
    assert {"gaps", "landing_s", "enabled", "_started_next", "last_decision"} <= names, names
    old = ("def attach(stage, shard, i):\n"
           "    shard.timings.enabled = False\n"
           "    shard.replicas.gaps = None\n"
           "    shard.replicas.landing_s = 0.0\n"
           "    shard.next._started_next = None\n"
           "    shard.last_decision = None\n")
    assert [line for line, _ in set_from_outside(old, names)] == [2, 3, 4, 5, 6]
    assert set_from_outside("def f(self):\n    self.gaps = None\n", names) == []


def test_nothing_is_set_on_a_shard_from_outside():
    """Every assignment in the package to a shard's own attribute is the shard's (or its part's)
    on itself, or the prefetch chain's links; per-step inputs come from ``StepContext``, the
    rest from the constructor (``ShardOptions``) or a method's arguments."""
    names = owned_names()
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        hits = set_from_outside(path.read_text(), names, skip_function=CHAIN[1] if rel == CHAIN[0] else None)
        if hits:
            found[rel] = hits
    assert not found, found


def stage_set_from_outside(source: str) -> list:
    """``(line, target)`` of every assignment to an attribute of the FSSDP stage (a name ``stage``, or
    ``<engine>.fssdp``) or of its parts (``stage.norm.x``) outside the stage itself."""
    def is_stage(v):
        while isinstance(v, ast.Attribute) and v.attr != "fssdp":
            v = v.value
        return isinstance(v, ast.Attribute) or (isinstance(v, ast.Name) and v.id == "stage")
    return [(node.lineno, ast.unparse(t)) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for t in _targets(node) if isinstance(t, ast.Attribute) and is_stage(t.value)]


def test_nothing_is_set_on_the_stage_from_outside():
    """The stage's groups, pipeline layout and global layers come in at construction, its micro-batches
    in flight, trace file and norm's pipeline group from them, a checkpoint's steps and planning state through
    ``FSSDPStage.restore``: no module assigns to the stage's attributes (negative control: the
    assignments ``initialize`` once made are found)."""
    old = ("stage.groups = groups\nif pipe:\n    stage.layout, stage.global_layers = layout, g\n"
           "engine.fssdp.in_flight = 2\nstage.norm.dense_group = None\n")
    assert sorted(line for line, _ in stage_set_from_outside(old)) == [1, 3, 3, 4, 5]
    found = {rel: hits for path in sorted(PACKAGE.rglob("*.py"))
             if (rel := path.relative_to(PACKAGE).as_posix()) != "runtime/stage.py"
             and (hits := stage_set_from_outside(path.read_text()))}
    assert not found, found


def test_how_a_shard_runs_is_fixed_at_construction():
    """Side work and timings are ``ShardOptions`` (frozen): set once, by whoever builds the shard."""
    import dataclasses
    from ds_fssdp.moe.sharded import ShardOptions
    options = ShardOptions(side=True, timed=False)
    assert options.side is True and options.timed is False and ShardOptions().side is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.side = False


def _imports(path: pathlib.Path) -> list:
    """(module imported, at module level) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
    return out


PAIRS = [("planner/balance.py", "ds_fssdp.planner.dispatch", "planner/dispatch.py", "ds_fssdp.planner.balance"),
         ("integrations/hf_experts.py", "ds_fssdp.integrations.peft_lora", "integrations/peft_lora.py",
          "ds_fssdp.integrations.hf_experts")]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
def test_no_import_circle(pair):
    """One direction only: the lower module never imports the upper one, not even inside a
    function (where a circle hides), and the upper one imports it at module level."""
    lower, upper_name, upper, lower_name = pair
    assert all(module != upper_name for module, _ in _imports(PACKAGE / lower)), lower
    assert (lower_name, True) in _imports(PACKAGE / upper), upper


@pytest.mark.parametrize("module", ["ds_fssdp.planner.balance", "ds_fssdp.planner.dispatch",
                                    "ds_fssdp.integrations.hf_experts", "ds_fssdp.integrations.peft_lora"])
def test_each_imports_fresh(module):
    """Each module of the former circles imports first in a fresh interpreter."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT, timeout=300,
                   capture_output=True)


def test_the_planner_and_ops_are_pure():
    """planner/ and ops/ import neither DeepSpeed nor the runtime's layers (comm, runtime, moe), not
    even inside a function (the C extension's fallback once imported DeepSpeed's logger)."""
    impure = ("deepspeed", "ds_fssdp.comm", "ds_fssdp.runtime", "ds_fssdp.moe", "ds_fssdp.integrations")
    found = {str(p.relative_to(ROOT)): m for p in [*(PACKAGE / "planner").rglob("*.py"), *(ROOT / "ops").rglob("*.py")]
             for m, _ in _imports(p) if m.startswith(impure)}
    assert not found, found
    assert ("deepspeed", True) in _imports(PACKAGE / "runtime" / "engine.py")  # the scan sees an import


def test_the_replay_runs_without_deepspeed():
    """``ds_fssdp.report`` (its replay and its command line) checks a run offline: importing it
    imports no DeepSpeed (the planner's record, ``planner/decision.py``, and the config's
    defaults, ``defaults.py``, need none)."""
    code = ("import sys, ds_fssdp.report.replay, ds_fssdp.report.__main__; "
            "assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ds_fssdp'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)
    # the planner without its C extension (a source tree never built) says so without DeepSpeed's logger
    code = ("import sys; sys.modules['ds_fssdp.planner._fastplan'] = None; import ds_fssdp.planner.fast as f, "
            "ds_fssdp.report.replay; assert not f.AVAILABLE and 'deepspeed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)
    # Negative control: the runtime's shard does import it (the check can see an import).
    code = "import sys, ds_fssdp.moe.sharded; assert 'deepspeed' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300, capture_output=True)

"""The ``gradscope`` CLI: exit codes and findings checked against what torch does with the same target."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
import torch
from click.testing import CliRunner

import gradscope
from gradscope import demo
from gradscope.cli.commands import main
from gradscope.cli.target import load
from tests.conftest import grads_none

TARGETS = '''
import torch
from torch import nn


def make(use_all):
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(6, 8), "head": nn.Linear(8, 1), "unused_head": nn.Linear(8, 3)})
    x = torch.randn(5, 6)
    out = model.head(torch.relu(model.body(x))).sum()
    if use_all:
        out = out + model.unused_head(torch.relu(model.body(x))).sum()
    return out, model


def buggy():
    return make(False)


def clean():
    return make(True)


def loss_only():
    return clean()[0]


def vector():
    return clean()[0] * torch.ones(3)


def raises():
    return torch.ones(2, 3) @ torch.ones(4, 5)


def chatty():
    print("epoch 1 of a user's print")
    return clean()


def returns_float():
    return 3.0


def returns_pair_without_model():
    return clean()[0], "model"


def string_loss_with_model():
    return "loss", clean()[1]


def takes_args(x, y=1):
    return x


def no_grad_loss():
    with torch.no_grad():
        return clean()[0]


def exits():
    raise SystemExit(3)


not_a_function = 42
'''


def _run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


@pytest.fixture
def targets(tmp_path):
    path = tmp_path / "targets.py"
    path.write_text(TARGETS)
    return path


def _call(path, name):
    spec = importlib.util.spec_from_file_location("_cli_ground_truth", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


# -- check: exit 1 vs 0 from real findings --------------------------------------------------------
@pytest.mark.parametrize("name,code,said,without_grad", [
    ("buggy", 1, "unused-parameter", {"unused_head.weight", "unused_head.bias"}),  # an unused head: exit 1
    ("clean", 0, "No findings", set()),                                            # every parameter gets one
])
def test_check_exit_code_follows_the_parameters_torch_leaves_without_grad(targets, name, code, said, without_grad):
    result = _run("check", f"{targets}:{name}")
    assert result.exit_code == code, result.output
    assert said in result.stdout
    loss, model = _call(targets, name)
    loss.backward()
    assert grads_none(model) == without_grad
    for param in grads_none(model):
        assert param in result.stdout


def test_check_json_lists_the_findings_with_their_parameters(targets):
    result = _run("check", f"{targets}:buggy", "--json")
    assert result.exit_code == 1
    found = json.loads(result.stdout)
    assert [f["kind"] for f in found] == ["unused-parameter"]
    assert sorted(found[0]["params"]) == ["unused_head.bias", "unused_head.weight"]


def test_the_targets_prints_go_to_stderr_so_json_stays_clean(targets):
    result = _run("check", f"{targets}:chatty", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == []
    assert "epoch 1 of a user's print" in result.stderr


def test_fail_on_warning_turns_a_non_scalar_root_into_exit_1(targets):
    with pytest.raises(RuntimeError, match="scalar"):  # torch: backward() needs gradient=
        _call(targets, "vector").backward()
    assert _run("check", f"{targets}:vector").exit_code == 0
    result = _run("check", f"{targets}:vector", "--fail-on", "warning")
    assert result.exit_code == 1
    assert "non-scalar-root" in result.stdout


def test_a_loss_without_a_model_is_accepted(targets):
    result = _run("check", f"{targets}:loss_only")
    assert result.exit_code == 0
    assert "No findings" in result.stdout


def test_module_target_imports_from_the_current_folder(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "losses.py").write_text(TARGETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert _run("check", "mypkg.losses:buggy").exit_code == 1
    assert _run("check", "mypkg.losses:clean").exit_code == 0


def test_file_target_imports_its_neighbours(tmp_path, monkeypatch):
    (tmp_path / "helper_for_target.py").write_text("from torch import nn\nMODEL = nn.Linear(3, 1)\n")
    (tmp_path / "uses_helper.py").write_text(
        "import torch\nfrom helper_for_target import MODEL\n"
        "def main():\n    return MODEL(torch.ones(2, 3)).sum(), MODEL\n")
    monkeypatch.chdir(os.path.dirname(gradscope.__file__))
    before = list(sys.path)
    try:
        result = _run("check", f"{tmp_path / 'uses_helper.py'}:main")
    finally:
        sys.modules.pop("helper_for_target", None)
    assert result.exit_code == 0, result.output
    assert sys.path == before


# -- user mistakes: exit 2, one line, no traceback ------------------------------------------------
MISTAKES = [
    ("{d}/missing.py:f", r"No such file: '.*missing\.py'"),
    ("{d}/targets.py", r"does not name a function"),
    ("{d}/targets.py:nope", r"has no function 'nope'; it defines: make, buggy, clean"),
    ("{d}/targets.py:not_a_function", r"is an int, not a function"),
    ("{d}/targets.py:raises", r"raised RuntimeError: (mm: )?mat1 and mat2 shapes cannot be multiplied "
                              r"\(2x3 and 4x5\) \(at .*targets\.py:\d+\)"),
    ("{d}/targets.py:exits", r"raised SystemExit: 3"),
    ("{d}/targets.py:returns_float", r"returned float 3\.0; it must return the loss tensor"),
    ("{d}/targets.py:returns_pair_without_model", r"returned tuple .*; it must return the loss tensor"),
    ("{d}/targets.py:string_loss_with_model", r"inspect\(\) needs a tensor \(the loss\)"),  # InputTypeError
    ("{d}/targets.py:takes_args", r"takes arguments \(x, y=1\)"),
    ("{d}/targets.py:no_grad_loss", r"has no grad_fn and does not require grad"),
    ("{d}/syntax.py:f", r"Cannot import .*syntax\.py: SyntaxError at .*syntax\.py:1"),
    ("{d}/badimport.py:f", r"Importing .*badimport\.py raised ModuleNotFoundError: "
                           r"No module named 'no_such_module_for_gradscope' \(at .*badimport\.py:2\)"),
    ("{d}/crash.py:f", r"Importing .*crash\.py raised ZeroDivisionError: division by zero \(at .*crash\.py:1\)"),
    ("no_such_package_xyz.mod:f", r"No module named 'no_such_package_xyz'"),
    ("not a module:f", r"neither a \.py file nor a module name"),
]


def _one_line_error(result, pattern):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("command", ["check", "render"])
@pytest.mark.parametrize("target,pattern", MISTAKES)
def test_user_mistakes_exit_2_with_one_line(tmp_path, targets, command, target, pattern):
    (tmp_path / "syntax.py").write_text("def f(:\n    pass\n")
    (tmp_path / "badimport.py").write_text("import os\nimport no_such_module_for_gradscope\n")
    (tmp_path / "crash.py").write_text("x = 1 / 0\n")
    extra = ["-o", str(tmp_path / "g.dot")] if command == "render" else []
    result = CliRunner().invoke(main, [command, target.format(d=tmp_path), *extra])
    _one_line_error(result, pattern)
    assert not (tmp_path / "g.dot").exists()


def test_the_function_raising_matches_what_torch_raises(targets):
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\)"):
        _call(targets, "raises")


@pytest.mark.parametrize("args,pattern", [
    (["-o", "{d}/g.jpg"], r"Cannot tell the format of -o '.*g\.jpg' \(\.jpg\)"),
    (["-o", "{d}/g"], r"\(no suffix\)"),
    (["-o", "{d}/g", "--format", "jpeg"], r"Unknown --format 'jpeg'; use one of svg, png, pdf"),
    (["-o", "{d}/g.svg", "--format", "png"], r"ends in \.svg but --format is 'png'"),
    (["-o", "{d}/no/such/dir/g.svg"], r"the folder '.*dir' does not exist"),
])
def test_bad_output_options_exit_2_before_running_the_target(tmp_path, targets, args, pattern):
    args = [a.format(d=tmp_path) for a in args]
    _one_line_error(CliRunner().invoke(main, ["render", f"{targets}:buggy", *args]), pattern)


def test_missing_graphviz_is_one_line(tmp_path, targets):
    no_dot = tmp_path / "empty_bin"
    no_dot.mkdir()
    result = CliRunner().invoke(main, ["render", f"{targets}:clean", "-o", str(tmp_path / "g.svg")],
                                env={"PATH": str(no_dot)})
    _one_line_error(result, r"Cannot write \.svg: the Graphviz 'dot' program is not on PATH")
    # formats that need no Graphviz still work without it
    result = CliRunner().invoke(main, ["render", f"{targets}:clean", "-o", str(tmp_path / "g.dot")],
                                env={"PATH": str(no_dot)})
    assert result.exit_code == 0 and (tmp_path / "g.dot").read_text().startswith("digraph")


def test_unwritable_output_is_one_line(tmp_path, targets):
    (tmp_path / "taken.svg").mkdir()          # a folder where the file should go
    result = CliRunner().invoke(main, ["render", f"{targets}:clean", "-o", str(tmp_path / "taken.svg")])
    _one_line_error(result, r"Cannot write '.*taken\.svg': it is a folder")


def test_bad_option_values_are_usage_errors(targets):
    result = CliRunner().invoke(main, ["render", f"{targets}:clean", "--collapse", "-1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--collapse" in result.stderr
    result = CliRunner().invoke(main, ["check"])
    assert result.exit_code == 2 and "Missing argument 'TARGET'" in result.stderr


# -- help, version ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["render"], ["check"], ["demo"], ["diff"]])
def test_every_help_has_an_example(command):
    if command and command[0] not in main.commands:
        pytest.skip(f"no {command[0]} command")
    result = _run(*command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.stdout and "gradscope " in result.stdout


def test_version():
    result = _run("--version")
    assert result.exit_code == 0 and gradscope.__version__ in result.stdout


def test_diff_is_registered_when_the_diff_command_exists():
    have = importlib.util.find_spec("gradscope.cli.diff") is not None
    assert ("diff" in main.commands) == have


# -- render ----------------------------------------------------------------------------------------
def test_render_json_round_trips_through_networkx(tmp_path, targets):
    out = tmp_path / "g.json"
    result = _run("render", f"{targets}:buggy", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stderr
    graph = nx.node_link_graph(json.loads(out.read_text()))
    loaded = load(f"{targets}:buggy")
    report = gradscope.inspect(loaded.loss, model=loaded.model)
    assert graph.number_of_nodes() == report.graph.number_of_nodes()


def test_render_format_option_adds_the_suffix_and_passes_options(tmp_path, targets):
    result = _run("render", f"{targets}:buggy", "-o", str(tmp_path / "g"), "--format", "DOT",
                  "--collapse", "1", "--no-show-saved")
    assert result.exit_code == 0, result.output
    loaded = load(f"{targets}:buggy")
    report = gradscope.inspect(loaded.loss, model=loaded.model, trace=loaded.trace)
    assert (tmp_path / "g.dot").read_text() == report.to_dot(collapse=1, show_saved=False).source


def test_big_graph_says_it_collapsed_and_expand_draws_every_node(tmp_path):
    from gradscope.views.render import AUTO_LIMIT

    steps = AUTO_LIMIT // 2 + 10
    (tmp_path / "chain.py").write_text(
        "import torch\n"
        "def chain():\n"
        "    w = torch.nn.Parameter(torch.ones(4))\n"
        "    x = torch.ones(4)\n"
        f"    for _ in range({steps}):\n"
        "        x = torch.tanh(x * w)\n"
        "    return x.sum()\n")
    target = f"{tmp_path / 'chain.py'}:chain"
    loaded = load(target)
    report = gradscope.inspect(loaded.loss, trace=loaded.trace)
    assert report.graph.number_of_nodes() > AUTO_LIMIT
    auto = _run("render", target, "-o", str(tmp_path / "auto.dot"))
    assert auto.exit_code == 0 and "collapsed automatically" in auto.stderr and "--expand" in auto.stderr
    full = _run("render", target, "-o", str(tmp_path / "full.dot"), "--expand")
    assert full.exit_code == 0 and "collapsed automatically" not in full.stderr
    assert (tmp_path / "full.dot").read_text() == report.to_dot(collapse=False).source
    assert (tmp_path / "auto.dot").read_text() == report.to_dot().source
    both = CliRunner().invoke(main, ["render", target, "-o", str(tmp_path / "x.dot"), "--expand",
                                     "--collapse", "1"])
    _one_line_error(both, r"--expand and --collapse 1 contradict each other")


def test_format_added_after_a_suffix_that_is_not_a_format(tmp_path, targets):
    result = _run("render", f"{targets}:clean", "-o", str(tmp_path / "run.v2"), "-f", "json")
    assert result.exit_code == 0, result.output
    assert nx.node_link_graph(json.loads((tmp_path / "run.v2.json").read_text())).number_of_nodes() > 0


def test_cli_formats_are_the_renderers():
    from gradscope.cli import rendering as cli
    from gradscope.views import render

    assert cli.FORMATS == render.FORMATS


def test_render_svg_is_xml_and_names_the_unused_parameters(tmp_path, targets):
    out = tmp_path / "g.svg"
    result = _run("render", f"{targets}:buggy", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert ET.parse(out).getroot().tag.endswith("svg")
    assert "unused_head.weight" in out.read_text()


def test_demo_renders_and_prints_the_planted_bugs_that_torch_confirms(tmp_path):
    out = tmp_path / "demo.svg"
    result = _run("demo", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert ET.parse(out).getroot().tag.endswith("svg")
    assert "inplace-hazard" in result.stdout
    assert "aux_head.weight" in result.stdout
    # ground truth: the buggy loss cannot be backpropagated, and aux_head is unreachable from it
    loss, model = demo.buggy()
    assert torch.autograd.grad(loss, list(model.aux_head.parameters()), allow_unused=True) == (None, None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss, model = demo.fixed()
    loss.backward()
    assert grads_none(model) == set()


def test_demo_under_trace_points_at_the_planted_lines():
    result = _run("check", "gradscope.demo:buggy")
    assert result.exit_code == 1
    lines = open(demo.__file__).read().splitlines()
    detach = next(i for i, line in enumerate(lines, 1) if "BUG 1" in line)
    clamp = next(i for i, line in enumerate(lines, 1) if "BUG 2" in line)
    assert ".detach()" in lines[detach - 1] and ".clamp_(" in lines[clamp - 1]
    if not callable(getattr(gradscope, "trace", None)):
        pytest.skip("gradscope.trace() is not available")
    assert re.search(rf"detached-branch  \S*demo\.py:{detach}\n", result.stdout), result.stdout
    assert re.search(rf"inplace-hazard  at .*demo\.py:{clamp}\n", result.stdout), result.stdout
    untraced = _run("check", "gradscope.demo:buggy", "--no-trace")
    assert "unused-parameter" in untraced.stdout and "demo.py:" not in untraced.stdout


# -- real processes ----------------------------------------------------------------------------------
def _script():
    found = shutil.which("gradscope", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("the gradscope console script is not installed next to this python (pip install -e .)")
    return found


def test_console_script_exit_codes(targets):
    script = _script()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    bad = subprocess.run([script, "check", f"{targets}:buggy"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "unused-parameter" in bad.stdout
    missing = subprocess.run([script, "check", f"{targets}:nope"], capture_output=True, text=True,
                             env=env, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [missing.stderr.strip()]
    assert "Traceback" not in missing.stderr and "has no function 'nope'" in missing.stderr


def test_make_demo_command(tmp_path):
    """What `make demo` runs: `.venv/bin/gradscope demo -o demo.svg`."""
    done = subprocess.run([_script(), "demo", "-o", "demo.svg"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert ET.parse(tmp_path / "demo.svg").getroot().tag.endswith("svg")
    assert "inplace-hazard" in done.stdout and "aux_head" in done.stdout


def test_python_dash_m(targets):
    done = subprocess.run([sys.executable, "-m", "gradscope", "check", f"{targets}:clean"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "No findings" in done.stdout


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("args", [["--help"], ["memory", "--help"], ["--version"]])
def test_help_does_not_import_torch(args):
    """``gradscope --help`` answers without importing torch (about 2 s): the package's names are lazy
    (PEP 562) and the commands import the library inside their bodies."""
    code = (
        "import sys\n"
        "from gradscope.cli.commands import main\n"
        f"try:\n    main({args!r}, prog_name='gradscope')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": _ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False", done.stdout
    assert "Usage: gradscope" in done.stdout or "version" in done.stdout


def test_the_lazy_package_still_answers_every_public_name():
    code = (
        "import sys, gradscope\n"
        "assert 'torch' not in sys.modules\n"
        "names = [getattr(gradscope, n) for n in gradscope.__all__]\n"
        "assert 'torch' in sys.modules and gradscope.inspect.__module__ == 'gradscope.inspection'\n"
        "assert callable(gradscope.memory.cpu_kernels_on_meta) and 'memory' in dir(gradscope)\n"
        "try:\n    gradscope.nope\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": _ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "module 'gradscope' has no attribute 'nope'"

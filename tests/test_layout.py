"""The layout reads like the method: imports point one way and never in a cycle.

Every `import` in the library's modules, including those inside functions, is an edge of the
graph: `from a.b import c` goes to module `a.b.c` when that is a module, else to `a.b`.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("glm5_jax", "pallas_kernels")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: pathlib.Path, modules) -> set[str]:
  """The project modules `path` imports."""
  return {m for m in _all_imports(path, modules)
          if m.split(".")[0] in PACKAGES + ("experiments", "tests", "configs")}


def _all_imports(path: pathlib.Path, modules) -> set[str]:
  """Every module `path` imports, the project's and others (jax, numpy, ...)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        out.add(sub if sub in modules else node.module)
  return out


@pytest.fixture(scope="module")
def graph():
  modules = _modules()
  return {name: _imports(path, modules) for name, path in modules.items()}


def _cycles(graph):
  """Strongly connected components of more than one module (Tarjan), or with a self-edge."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in graph:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 or v in graph[v]:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_module_imports_in_a_cycle(graph):
  assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# (importer prefix, imported prefix): edges the layout forbids, and why.
FORBIDDEN = [
    ("glm5_jax.nn", "glm5_jax.losses"),            # the model does not depend on the losses
    ("glm5_jax.nn", "glm5_jax.train"),
    ("glm5_jax.losses", "pallas_kernels"),          # kernels are reached through nn/dsa.py
    ("glm5_jax.nn.moe_ep", "glm5_jax.nn.moe"),      # both use nn/ffn.py's expert kernels
    ("glm5_jax.train", "glm5_jax.rl"),              # RL builds on training, not the reverse
    # RL in three levels (glm5_jax/rl/__init__.py): orchestration -> envs -> algorithm.
    ("glm5_jax.rl.algorithm", "glm5_jax.rl.envs"),
    ("glm5_jax.rl.algorithm", "glm5_jax.rl.orchestration"),
    ("glm5_jax.rl.envs", "glm5_jax.rl.orchestration"),
    ("glm5_jax", "glm5_jax.rl.sandbox"),            # former paths, kept for users only
    ("glm5_jax", "glm5_jax.rl.losses"),
    ("glm5_jax", "experiments"),                    # entry points call the library
    ("glm5_jax", "configs"),
    ("glm5_jax", "tests"),
    ("pallas_kernels", "glm5_jax"),                 # the kernels stand alone
]


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_imports_point_one_way(graph, importer, imported):
  under = lambda m, p: m == p or m.startswith(p + ".")
  bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if under(m, importer)
               for d in deps if under(d, imported))
  assert bad == []


def test_the_kernels_xla_paths_are_reached_through_their_packages(graph):
  """The library reaches a kernel's XLA path (`xla.py`, plain jnp) only through the kernel
  package's API, never the module itself."""
  bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("glm5_jax")
               for d in deps if d.startswith("pallas_kernels") and d.count(".") > 1)
  assert bad == []


def test_the_kernels_are_reached_only_through_dsa(graph):
  users = sorted(m for m, deps in graph.items() if m.startswith("glm5_jax")
                 and any(d.startswith("pallas_kernels") for d in deps))
  assert users == ["glm5_jax.nn.dsa"]


RL_LEVELS = ("algorithm", "envs", "orchestration")
RL_REEXPORTS = ("losses", "sandbox")   # former paths of moved modules


def test_every_rl_module_sits_in_a_level(graph):
  loose = sorted(m for m in graph if m.startswith("glm5_jax.rl.")
                 and m.split(".")[2] not in RL_LEVELS + RL_REEXPORTS)
  assert loose == []


def test_former_import_paths_reach_the_moved_code():
  """Modules moved in the layout keep their former import paths as re-exports."""
  import importlib  # pylint: disable=g-import-not-at-top
  li = "pallas_kernels.lightning_indexer"
  same = [("glm5_jax.rl.sandbox", "run_python", "glm5_jax.rl.envs.sandbox"),
          ("glm5_jax.rl.losses", "icepop_grpo_loss", "glm5_jax.policy_losses"),
          ("glm5_jax.hf", "load_pretrained", "glm5_jax.hf_load"),
          ("glm5_jax.hf", "save_pretrained", "glm5_jax.hf_save"),
          ("glm5_jax.train.checkpoint", "load_model", "glm5_jax.convert"),
          (li, "index_scores", f"{li}.xla"), (li, "deterministic_topk", f"{li}.xla"),
          (li, "topk_indices", f"{li}.api")]
  for old, name, new in same:
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new),
                                                                   name), (old, name)


# Modules that run on the host only: neither they nor a project module they import
# (transitively) import a device library.
HOST_ONLY = ("glm5_jax.inference.scheduler",)
DEVICE_LIBRARIES = ("jax", "jaxlib", "flax")


def _device_imports(module, graph, modules) -> list[str]:
  """Edges `m -> jax...` of `module` and every project module it reaches."""
  seen, todo, out = set(), [module], []
  while todo:
    m = todo.pop()
    if m in seen:
      continue
    seen.add(m)
    out += [f"{m} -> {d}" for d in sorted(_all_imports(modules[m], modules))
            if d.split(".")[0] in DEVICE_LIBRARIES]
    todo += [d for d in graph[m] if d in modules]
  return sorted(out)


@pytest.mark.parametrize("module", HOST_ONLY)
def test_host_only_modules_import_no_jax(graph, module):
  assert _device_imports(module, graph, _modules()) == []


def test_the_host_only_check_follows_imports(graph):
  """`glm5_jax.inference` imports no jax itself, but reaches it through the engine."""
  modules = _modules()
  assert not {"jax", "flax"} & _all_imports(modules["glm5_jax.inference"], modules)
  assert "glm5_jax.inference.engine -> jax" in _device_imports("glm5_jax.inference", graph,
                                                                modules)

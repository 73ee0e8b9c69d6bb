"""The library never imports Prefect or the application (flows, tasks): importing every module of
`layertap/` in a fresh interpreter leaves them out of sys.modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Imports each module in turn and names the first one that brought a forbidden package in.
PROBE = """
import importlib, json, pkgutil, sys
import layertap
FORBIDDEN = ("prefect", "flows", "tasks")
def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
names = sorted(m.name for m in pkgutil.walk_packages(layertap.__path__, "layertap."))
culprits = {}
for name in names:
    before = set(loaded())
    importlib.import_module(name)
    new = sorted(set(loaded()) - before)
    if new:
        culprits[name] = new
print(json.dumps({"modules": names, "culprits": culprits, "loaded": loaded()}))
"""


def test_no_library_module_imports_prefect_flows_or_tasks():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["modules"]) > 20 and "layertap.settings" in report["modules"]
    assert report["culprits"] == {} and report["loaded"] == []


def test_no_library_module_imports_them_inside_a_function_either():
    """Imports made on use (inside functions) escape the import-time check; the source says them all."""
    import ast

    found = []
    for path in sorted((ROOT / "layertap").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] in ("prefect", "flows", "tasks")]
    assert found == []

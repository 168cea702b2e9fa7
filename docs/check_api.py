"""Check that every public name of `ringeqx`, `ringeqx.nn` and `ringeqx.tools` has an API page.

Run by `nox -s docs` before the build (`python docs/check_api.py`); exits 1 naming each public
name that no `::: ringeqx.X` directive under `docs/api/` documents, and each directive that
names nothing public.
"""

import re
import sys
import types
from pathlib import Path

import ringeqx
import ringeqx.nn
import ringeqx.tools


API_DIR = Path(__file__).parent / "api"
_DIRECTIVE = re.compile(r"^\s*::: (ringeqx(?:\.[A-Za-z_][A-Za-z0-9_]*)+)\s*$", re.MULTILINE)


def public_names() -> set[str]:
    """Every name a user reaches as `ringeqx.X`, `ringeqx.nn.X` or `ringeqx.tools.X`,
    modules excepted (and the deprecated top-level tool names, which are not in
    `vars(ringeqx)`: the module's `__getattr__` finds them)."""
    names = set()
    for module in (ringeqx, ringeqx.nn, ringeqx.tools):
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, types.ModuleType):
                continue
            names.add(f"{module.__name__}.{name}")
    return names


def documented_names(api_dir: Path = API_DIR) -> set[str]:
    """The objects named by `::: ringeqx.X` directives in the API pages."""
    return {
        match for page in api_dir.glob("*.md") for match in _DIRECTIVE.findall(page.read_text())
    }


def main() -> int:
    public, documented = public_names(), documented_names()
    missing, unknown = sorted(public - documented), sorted(documented - public)
    for name in missing:
        print(f"{name} is public but on no page of docs/api/ (add `::: {name}`).")
    for name in unknown:
        print(f"docs/api/ documents {name}, which is not a public name.")
    if missing or unknown:
        return 1
    print(f"All {len(public)} public names of ringeqx, ringeqx.nn and tools are on an API page.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

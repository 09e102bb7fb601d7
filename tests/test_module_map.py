"""docs/design.md's module map (section 1) is true: every module under ds_fssdp/ and ops/ is named in
its folder's entry, and every file the map names exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_fssdp"
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _files(folder: str) -> list:
    if folder == "ds_fssdp":  # the package's own top-level modules
        return list(PACKAGE.glob("*.py"))
    return list((ROOT / "ops" if folder == "ops" else PACKAGE / folder).rglob("*.py"))


def map_errors(design: str) -> tuple:
    """``(named but missing, present but unnamed, folders without an entry)`` of the map's code block:
    an entry starts at a line beginning with its folders (``moe/``, ``models/ data/``)."""
    block = design.split("## 1. The pieces and their arrows", 1)[1].split("```", 2)[1].strip("\n")
    entries, folders = {}, ()
    for line in block.splitlines():
        head = re.match(r"(\w+/ ?)+", line)
        if head:
            folders = tuple(re.findall(r"\w+", head.group()))
        entries[folders] = entries.get(folders, "") + line[head.end() if head else 0:] + "\n"
    missing, unnamed = [], []
    for folders, text in entries.items():
        names = re.findall(r"[\w/]*\w+\.py\b", text)  # with a folder: from the package or the repository
        here = {p.name for f in folders for p in _files(f)}
        missing += [n for n in names if not (any((r / n).exists() for r in (PACKAGE, ROOT)) if "/" in n else n in here)]
        named = {n.split("/")[-1] for n in names} | {"__init__.py"}
        unnamed += [str(p.relative_to(ROOT)) for f in folders for p in _files(f) if p.name not in named]
    covered = {f for folders in entries for f in folders}
    absent = [p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_") and p.name not in covered]
    return missing, unnamed, absent


def test_the_module_map_is_true():
    assert map_errors(DESIGN) == ([], [], [])


def test_the_map_check_sees_a_file_gone_or_unnamed():
    """Negative control: an entry naming a file that does not exist, and a module the map omits."""
    edited = DESIGN.replace("place.py      the pre-gating", "gone.py       the pre-gating", 1)
    assert edited != DESIGN
    missing, unnamed, _ = map_errors(edited)
    assert missing == ["gone.py"] and unnamed == ["ds_fssdp/planner/place.py"]

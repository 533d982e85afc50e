"""Generated SWE tasks: the mutator (checked by hand), the split, and generation in Docker."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from swe_support import assert_no_leftovers, require_docker

from agentree.envs.swe import local_suite
from agentree.swe import generate
from agentree.swe.mutate import KINDS, mutations

SOURCE = '''def f(x, y):
    """Docstrings and annotations are never mutated: 5 < 6."""
    if x < 0:
        return -1
    z = g(x, y) + 3 * x
    if not x and y:
        return z
    else:
        z += 1
    return z - 1
'''


def _changed(src: str, new: str) -> list[tuple[str, str]]:
    old_lines, new_lines = src.splitlines(), new.splitlines()
    if len(old_lines) != len(new_lines):
        return [("<lines>", str(len(old_lines) - len(new_lines)))]
    return [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]


def test_mutations_of_a_small_function_are_exactly_the_hand_listed_ones():
    got = {(m.kind, m.line, m.description): m.source for m in mutations("a.py", SOURCE)}
    # Listed by hand from SOURCE: one entry per site and rule of agentree.swe.mutate.
    want = {
        ("drop_branch", 3, "dropped an `if` block"),
        ("comparison", 3, "`<` -> `<=`"),
        ("off_by_one", 3, "`0` -> `1`"),
        ("drop_return", 4, "dropped a `return`"),
        ("off_by_one", 4, "`1` -> `2`"),
        ("off_by_one", 4, "`1` -> `0`"),
        ("operator", 5, "`+` -> `-`"),
        ("swap_args", 5, "swapped arguments 1 and 2 of a call"),
        ("operator", 5, "`*` -> `/`"),
        ("off_by_one", 5, "`3` -> `4`"),
        ("off_by_one", 5, "`3` -> `2`"),
        ("constant", 5, "`3` -> `30`"),
        ("drop_branch", 6, "dropped an `else`/`elif` branch"),
        ("operator", 6, "`and` -> `or`"),
        ("operator", 6, "dropped `not`"),
        ("drop_return", 7, "dropped a `return`"),
        ("operator", 9, "`+=` -> `-=`"),
        ("off_by_one", 9, "`1` -> `2`"),
        ("off_by_one", 9, "`1` -> `0`"),
        ("drop_return", 10, "dropped a `return`"),
        ("operator", 10, "`-` -> `+`"),
        ("off_by_one", 10, "`1` -> `2`"),
        ("off_by_one", 10, "`1` -> `0`"),
    }
    assert set(got) == want
    # the edits touch only the mutated characters
    assert _changed(SOURCE, got[("comparison", 3, "`<` -> `<=`")]) == [
        ("    if x < 0:", "    if x <= 0:")
    ]
    assert _changed(SOURCE, got[("swap_args", 5, "swapped arguments 1 and 2 of a call")]) == [
        ("    z = g(x, y) + 3 * x", "    z = g(y, x) + 3 * x")
    ]
    assert _changed(SOURCE, got[("operator", 6, "dropped `not`")]) == [
        ("    if not x and y:", "    if x and y:")
    ]
    # a return alone in its block leaves a `pass`; the last return of the body just goes
    assert _changed(SOURCE, got[("drop_return", 7, "dropped a `return`")]) == [
        ("        return z", "        pass")
    ]
    assert "return z - 1" not in got[("drop_return", 10, "dropped a `return`")]
    dropped_else = got[("drop_branch", 6, "dropped an `else`/`elif` branch")]
    assert "else:" not in dropped_else and "z += 1" not in dropped_else
    for text in got.values():
        compile(text, "a.py", "exec")
        assert "5 < 6" in text


def test_edits_that_would_change_the_parse_are_rejected():
    # As text, flipping either operator of `a and b or c` gives a flat `a or b or c` or
    # `a and b and c`: not the tree the mutation means, so neither is offered. With the
    # parentheses written out both flips keep their meaning.
    ms = mutations("b.py", "def h(a, b, c):\n    return a and b or c\n")
    assert [m.description for m in ms if m.kind == "operator"] == []
    ms = mutations("b.py", "def h(a, b, c):\n    return (a and b) or c\n")
    got = {m.description: m.source for m in ms if m.kind == "operator"}
    assert got["`or` -> `and`"].endswith("return (a and b) and c\n")
    assert got["`and` -> `or`"].endswith("return (a or b) or c\n")


def test_comparison_chains_and_strings():
    src = 'def k(n, s):\n    return 1 <= n < 10 and s in ("a", "b")\n'
    got = {m.description: m.source for m in mutations("c.py", src)}
    assert "return 1 < n < 10" in got["`<=` -> `<`"]
    assert "return 1 <= n <= 10" in got["`<` -> `<=`"]
    assert "s not in" in got["`in` -> `not in`"]
    # a wrong constant borrows another string literal of the same file
    assert '("b", "b")' in got['`"a"` -> `"b"`']
    assert set(m.kind for m in mutations("c.py", src)) <= set(KINDS)


def test_bundled_repositories_give_every_kind():
    kinds = Counter(c.mutation.kind for c in generate.candidates())
    assert set(kinds) == set(KINDS)
    assert sum(kinds.values()) > 200


def _rec(i: int, file: str, kind: str) -> dict:
    return {"instance_id": f"t{i}", "repo": "r", "mutation": {"file": file, "kind": kind}}


def test_split_keeps_whole_groups_out_and_is_seeded():
    recs = [
        _rec(i, f"f{i % 5}.py", ("operator", "comparison", "constant")[i % 3]) for i in range(60)
    ]
    for by, key in (("file", "file"), ("kind", "kind")):
        s = generate.split_groups(recs, by=by, heldout=0.25, seed=3)
        assert s == generate.split_groups(recs, by=by, heldout=0.25, seed=3)
        held = {r["mutation"][key] for r in recs if s[r["instance_id"]] == "heldout"}
        train = {r["mutation"][key] for r in recs if s[r["instance_id"]] == "train"}
        assert held and train and not held & train
    # 5 files of 12 tasks each: 25% of 60 needs two files held out
    s = generate.split_groups(recs, by="file", heldout=0.25, seed=0)
    assert Counter(s.values()) == {"train": 36, "heldout": 24}


@pytest.mark.docker
def test_generate_validates_in_docker_and_the_records_grade_like_swebench(tmp_path):
    require_docker()
    from agentree.envs.swe.grading import grade
    from agentree.envs.swe.instances import from_record

    records, report = generate.generate(3, seed=1, slugs=["roman"], heldout=0.34)
    assert report.kept == 3 and len(records) == 3
    assert report.tried == 3 + sum(report.rejected.values())
    assert report.images == [local_suite.record("roman")["image"]]
    assert len({r["instance_id"] for r in records}) == 3
    for r in records:
        f2p, p2p = json.loads(r["FAIL_TO_PASS"]), json.loads(r["PASS_TO_PASS"])
        assert f2p and p2p and not set(f2p) & set(p2p)
        assert r["test_patch"] == "" and r["patch"].startswith("diff --git a/roman/")
        for t in f2p:
            assert t in r["problem_statement"]
    # graded by the swebench package in fresh containers: the fix resolves, no change does not
    inst = from_record(records[0])
    gold = grade(inst, inst.patch)
    assert gold.resolved, gold.reason
    empty = grade(inst, "")
    assert not empty.resolved
    assert set(empty.report["FAIL_TO_PASS"]["failure"]) == set(inst.fail_to_pass)
    assert set(empty.report["PASS_TO_PASS"]["success"]) == set(inst.pass_to_pass)
    assert_no_leftovers(allow_spares=True)


@pytest.mark.docker
def test_generate_command_writes_the_splits_and_a_report(tmp_path):
    require_docker()
    out = tmp_path / "gen.jsonl"
    cmd = [sys.executable, "-m", "agentree", "swe", "generate", "--n", "4", "--repos", "durations"]
    r = subprocess.run(
        [*cmd, "--output", str(out), "--split-by", "kind", "--seed", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "kept 4 of" in r.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    train = out.with_suffix(".train.jsonl").read_text().splitlines()
    held = out.with_suffix(".heldout.jsonl").read_text().splitlines()
    assert len(rows) == 4 == len(train) + len(held)
    held_kinds = {json.loads(x)["mutation"]["kind"] for x in held}
    train_kinds = {json.loads(x)["mutation"]["kind"] for x in train}
    assert not held_kinds & train_kinds
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["kept"] == 4 and report["images"] and report["image_disk_mb"] > 0

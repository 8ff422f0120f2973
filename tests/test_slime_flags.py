"""Every slime rollout flag is in plugin mode's table (rollout/slime/flags.py), the docs list the same flags, and a
refused flag set away from slime's default stops the first call with one line naming it.

The parser test builds slime's own argument parser (SLIME_SRC on PYTHONPATH, e.g. scripts/check_against_slime.sh's
Python), so a flag slime adds to a rollout-related group fails here until the table says what plugin mode does.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.slime_standin import REAL as SLIME_AVAILABLE

from rollout.slime import adapter as slime_adapter
from rollout.slime import attach, flags

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("add_rollout_arguments", "add_fault_tolerance_arguments", "add_data_arguments", "add_eval_arguments",
          "add_reward_model_arguments", "add_rollout_buffer_arguments")

# Run in a child (slime's arguments import SGLang and sglang_router): which group added each dest, with its
# default; the router and engine flags from slime's own add_sglang_arguments (its defaults set there).
_COLLECT = textwrap.dedent("""
    import argparse, collections, json, sys
    import slime.utils.arguments as A
    from slime.backends.sglang_utils import arguments as S
    p = argparse.ArgumentParser(allow_abbrev=False)
    groups, add = collections.defaultdict(dict), p.add_argument
    def record(*a, **k):
        act = add(*a, **k)
        f = sys._getframe(1)
        while f.f_code.co_name == "reset_arg":
            f = f.f_back
        groups[f.f_code.co_name][act.dest] = repr(act.default)
        return act
    p.add_argument = record
    A.get_slime_extra_args_provider()(p)
    q = argparse.ArgumentParser(allow_abbrev=False)
    S.add_sglang_arguments(q)
    groups["sglang"] = {a.dest: repr(a.default) for a in q._actions if a.dest != "help"}
    print(json.dumps(groups))
""")


def _slime_flags(tmp_path) -> dict:
    env = dict(os.environ)
    if importlib.util.find_spec("wandb") is None:   # slime's logging imports it; nothing here calls it
        (tmp_path / "wandb").mkdir()
        (tmp_path / "wandb" / "__init__.py").write_text('"""STUB: wandb is not installed; slime only imports it."""\n')
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _COLLECT], capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not SLIME_AVAILABLE, reason="slime is not importable (SLIME_SRC on PYTHONPATH)")
def test_every_rollout_flag_of_slimes_parser_is_in_the_table(tmp_path):
    groups = _slime_flags(tmp_path)
    assert all(groups.get(g) for g in GROUPS), f"slime's parser lost a group: {sorted(groups)}"
    rollout = {d: v for g in GROUPS + ("sglang",) for d, v in groups[g].items()}
    missing = sorted(d for d in rollout if flags.kind(d) is None)
    assert not missing, f"slime rollout flags missing from rollout/slime/flags.py: {missing}"
    every = {d: v for g in groups.values() for d, v in g.items()}
    stale = sorted(d for d in flags.FLAGS if d not in every)
    assert not stale, f"flags.py lists flags slime's parser does not have: {stale}"
    wrong = {d: (f.default, every[d]) for d, f in flags.FLAGS.items()
             if f.kind in (flags.REFUSED, flags.WARNED) and repr(f.default) != every[d]}
    assert not wrong, f"flags.py defaults differ from slime's parser (ours, slime's): {wrong}"


def _docs_rows() -> dict:
    text = (ROOT / "docs/slime.md").read_text()
    section = text.split("## Every slime rollout flag in plugin mode", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(--[a-z0-9*-]+)` \| \*\*([a-z]+)\*\*", section, re.M))


def test_docs_table_lists_the_same_flags_and_kinds_as_the_module():
    ours = {f.option: f.kind for f in list(flags.FLAGS.values()) + list(flags.PREFIXES.values())}
    docs = _docs_rows()
    assert sorted(set(ours) - set(docs)) == [], "in flags.py, not in docs/slime.md"
    assert sorted(set(docs) - set(ours)) == [], "in docs/slime.md, not in flags.py"
    assert {o: k for o, k in docs.items() if ours[o] != k} == {}, "kinds differ between docs and flags.py"


def test_warned_flags_are_the_ones_attach_warns_about():
    warned = {d: f.default for d, f in flags.FLAGS.items() if f.kind == flags.WARNED}
    assert {d: v[0] for d, v in attach.ROUTER_DEFAULTS.items()} == warned


class _NoData:
    def get_samples(self, n):
        raise AssertionError("the data source was read before the refusal")


@pytest.mark.parametrize("dest,value,line", [
    ("router_dp_aware", True, "--router-dp-aware True (slime's default False) is not supported in plugin mode: "
                              "plugin mode dispatches every request itself"),
    ("multimodal_keys", {"image": "images"}, "--multimodal-keys {'image': 'images'} (slime's default None) is not "
                                             "supported in plugin mode: plugin mode sends tokens only"),
    ("router_balance_abs_threshold", 64, "--router-balance-abs-threshold 64 (slime's default 10)"),
])
@pytest.mark.parametrize("evaluation", [False, True])
def test_a_refused_flag_away_from_slimes_default_stops_the_first_call_in_one_line(dest, value, line, evaluation):
    slime_adapter.reset()
    defaults = {d: f.default for d, f in flags.FLAGS.items() if f.kind == flags.REFUSED}
    args = SimpleNamespace(**dict(defaults, **{dest: value}), rollout_batch_size=1, n_samples_per_prompt=1)
    with pytest.raises(Exception) as e:
        slime_adapter.generate_rollout(args, 0, _NoData(), evaluation=evaluation)
    assert line in str(e.value) and "\n" not in str(e.value) and e.type is ValueError
    flags.refuse(SimpleNamespace(**defaults))   # every refused flag at slime's default: nothing to say

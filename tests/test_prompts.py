"""`run --prompts FILE`: a dataset read with slime's conventions (slime/utils/data.py at 624b824: `--input-key`
default `input`, `--label-key` default none, `--metadata-key` default `metadata`, blank lines skipped, chat
template with `add_generation_prompt=True` and plain text as one user message, text tokenized without special
tokens), and bad rows refused with one line naming the line."""
import importlib.util
import json
import os
import shutil

import pytest

from rollout import prompts
from rollout.cli import main
from rollout.errors import CliError

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")
DEMO = os.path.join(ROOT, "training_configs", "demo-prompts.jsonl")
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_model):
    return prompts.tokenizer_for(tiny_model)


@pytest.fixture(scope="module")
def chat_tok(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-tok")
    for f in ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model, f), d / f)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return prompts.tokenizer_for(str(d))


def _file(tmp_path, lines, name="p.jsonl"):
    p = tmp_path / name
    p.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(p)


def test_text_rows_label_metadata_and_blank_lines(tmp_path, tok):
    path = _file(tmp_path, [{"input": "two plus two", "label": "4", "metadata": {"id": 7}}, "",
                            {"input": "three", "label": "3"}])
    got = prompts.load(path, tok, prompts.DatasetKeys(label_key="label"))
    assert [p.ids for p in got] == [tok.encode("two plus two", add_special_tokens=False),
                                    tok.encode("three", add_special_tokens=False)]
    assert [(p.label, p.metadata) for p in got] == [("4", {"id": 7}), ("3", {})]
    assert len(prompts.load(path, tok, prompts.DatasetKeys(), limit=1)) == 1


def test_chat_template_for_text_and_messages(tmp_path, chat_tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = _file(tmp_path, [{"q": "hello"}, {"q": msgs}])
    got = prompts.load(path, chat_tok, prompts.DatasetKeys(input_key="q", apply_chat_template=True))
    assert chat_tok.decode(got[0].ids) == "<user>hello\n<assistant>"
    assert chat_tok.decode(got[1].ids) == "<system>be brief\n<user>hi\n<assistant>"


@pytest.mark.parametrize("lines,keys,text", [
    ([{"input": "a"}, {"input": "b"}, "{not json"], {}, "p.jsonl:line 3: not JSON"),
    ([{"input": "a"}, {"prompt": "b"}], {}, "p.jsonl:line 2: no key 'input' (--input-key)"),
    ([{"input": "a", "label": 1}, "", {"input": "b"}], {"label_key": "label"},
     "p.jsonl:line 3: no key 'label' (--label-key)"),
    ([{"input": [{"role": "user", "content": "x"}]}], {},
     "line 1: 'input' is a list of messages; pass --apply-chat-template"),
    ([{"input": "a", "metadata": [1]}], {}, "line 1: 'metadata' must be an object, got list"),
    ([[1, 2]], {}, "line 1: expected a JSON object, got list"),
    ([{"input": 5}], {}, "line 1: 'input' is neither text nor a list of {role, content} messages"),
    ([{"input": "a"}], {"apply_chat_template": True}, "the model's tokenizer has no chat template"),
])
def test_bad_rows_name_the_line(tmp_path, tok, lines, keys, text):
    with pytest.raises(CliError) as e:
        prompts.load(_file(tmp_path, lines), tok, prompts.DatasetKeys(**keys))
    assert text in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed")
def test_parquet_rows(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": ["x", "y"], "label": ["1", "2"]}), tmp_path / "p.parquet")
    got = prompts.load(str(tmp_path / "p.parquet"), tok, prompts.DatasetKeys(label_key="label"))
    assert [p.label for p in got] == ["1", "2"]


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow installed")
def test_parquet_without_pyarrow_is_one_line(tmp_path, tok):
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(CliError, match="p.parquet is Parquet but pyarrow is not installed"):
        prompts.load(str(tmp_path / "p.parquet"), tok, prompts.DatasetKeys())


def test_shipped_demo_prompts(tok):
    got = prompts.load(DEMO, tok, prompts.DatasetKeys(label_key="label"))
    assert len(got) == 16 and all(p.ids and p.label and p.metadata["source_name"] for p in got)


def _run_bad(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_cli_refuses_a_bad_file_before_writing_anything(tmp_path, capsys):
    bad = _file(tmp_path, [{"input": "a"}, {"input": "b"}, {"text": "c"}])
    out = tmp_path / "r.jsonl"
    err = _run_bad(capsys, ["run", "--config", TINY, "--prompts", bad, "--output", str(out)])
    assert "p.jsonl:line 3: no key 'input' (--input-key)" in err
    assert not out.exists() and not (tmp_path / "r.jsonl.run.json").exists()
    err = _run_bad(capsys, ["run", "--config", TINY, "--prompts", DEMO, "--num-groups", "17", "--output", str(out)])
    assert "--num-groups 17: demo-prompts.jsonl holds only 16 row(s)" in err


def test_cli_resume_refuses_a_changed_file_and_keeps_the_output(tmp_path, capsys):
    data = _file(tmp_path, [{"input": "a"}, {"input": "b"}])
    out = tmp_path / "r.jsonl"
    meta = {"run_id": "a", "config": TINY, "seed": 0, "num_groups": 2,
            "prompts": prompts.describe(data, prompts.DatasetKeys())}
    (tmp_path / "r.jsonl.run.json").write_text(json.dumps(meta))
    out.write_text('{"group_id": "a-g0"}\n')
    with open(data, "a") as fh:
        fh.write('{"input": "c"}\n')
    err = _run_bad(capsys, ["run", "--resume", str(out)])
    assert "is missing or changed since the run began" in err and out.read_text() == '{"group_id": "a-g0"}\n'
    err = _run_bad(capsys, ["run", "--resume", str(out), "--prompts", DEMO])
    assert "--prompts" in err and "differs from the run being resumed" in err


def test_non_utf8_bytes_are_one_line_naming_the_line(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"input": "ok"}\n{"input": "caf\xe9"}\n')
    with pytest.raises(CliError, match=r"p.jsonl:line 2: not UTF-8 \(byte 0xe9 at column 15\)"):
        prompts.load(str(path), tok, prompts.DatasetKeys())

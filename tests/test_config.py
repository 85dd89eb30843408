"""Configuration: merge order, first-run file, validation messages, CLI flags."""

import pytest
import yaml

from ktlong.config import (DEFAULT_FILE, Config, default_config, load_config, option_names, options_in, parse_set,
                           read_yaml_options)
from ktlong.options import KINDS, OPTIONS, render_defaults
from ktlong.errors import ConfigError


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "ktlong" / "config.yaml"


def test_default_file_is_the_declarations_rendered():
    """configs/default.yaml cannot drift from ktlong/options.py: it is their rendering, and it
    reads back as their defaults; every option once, with a comment."""
    assert DEFAULT_FILE.read_text() == render_defaults(), "run python -m ktlong.config defaults"
    values = yaml.safe_load(DEFAULT_FILE.read_text())
    assert list(values) == option_names() == list(OPTIONS)
    for name, o in OPTIONS.items():
        assert values[name] == o.default and type(values[name]) is type(o.default), name
    lines = [l for l in DEFAULT_FILE.read_text().splitlines() if l and not l.startswith("#")]
    assert all("#" in l.split(":", 1)[1] for l in lines), "every option needs a comment"


def test_declarations_are_whole():
    """Each default passes its own checks, each help names every choice, and the config's fields
    are the declarations."""
    assert list(Config.__dataclass_fields__) == [*OPTIONS, "sources"]
    for name, o in OPTIONS.items():
        default_config(**{name: o.default})  # checked like any value
        assert o.type in KINDS, name
        for choice in o.choices:
            assert choice in o.help, f"{name}'s help does not name its choice {choice}"


def test_flags_follow_the_declarations(capsys):
    """Each declared flag sets its option, with the option's type and choices."""
    import local_chat
    from ktlong.server.__main__ import build_parser as server_parser
    from ktlong.session.startup import FLAG_TO_OPTION, overrides_from

    samples = {"str": "x", "int": "3", "float": "0.5"}
    for name, o in OPTIONS.items():
        if not o.flag:
            continue
        server = name in options_in("server")
        parser = server_parser() if server else local_chat.build_parser()
        if o.type in ("bool", "auto_bool"):
            argv, expected = [f"--no-{o.flag}"], False
        else:
            raw = o.choices[-1] if o.choices else samples[o.type]
            argv, expected = [f"--{o.flag}", raw], {"int": int, "float": float, "str": str}[o.type](raw)
        assert FLAG_TO_OPTION[o.flag] == name
        assert overrides_from(parser.parse_args(argv)) [name] == (expected, f"--{o.flag}"), name
        if o.choices:
            with pytest.raises(SystemExit):
                parser.parse_args([f"--{o.flag}", "no-such-choice"])
    capsys.readouterr()


def test_issue_options_exist():
    required = """chunk_size max_seq_len block_size local_windows_len second_select_num threads_num
    anchor_type anchor_num kv_type dense_layer_num preselect_block preselect_block_count
    head_select_mode layer_step token_step prefill_attention selector alpha sink_blocks
    window_blocks subgroup_size attention_backend device gpu_memory_budget_gb temperature top_p
    top_k rope_scaling rope_scale yarn_orig_ctx""".split()
    assert set(required) <= set(option_names())


def test_first_run_writes_commented_copy_honouring_xdg(user_file):
    config = load_config()
    assert user_file.is_file()
    assert yaml.safe_load(user_file.read_text()) is None  # every option commented out
    assert "# block_size: 128" in user_file.read_text()
    assert config.block_size == 128 and config.where("block_size") == "default"


def test_merge_order_defaults_user_file_config_flags(user_file, tmp_path):
    load_config()
    user_file.write_text("block_size: 64\nchunk_size: 1024\nalpha: 0.3\n")
    extra = tmp_path / "extra.yaml"
    extra.write_text("chunk_size: 2048\n")
    config = load_config(str(extra), parse_set(["alpha=0.5"]))
    assert (config.block_size, config.chunk_size, config.alpha) == (64, 2048, 0.5)
    assert config.where("block_size") == f"{user_file}:1"
    assert config.where("chunk_size") == f"{extra}:1"
    assert config.where("alpha") == "--set alpha"
    assert config.token_step == 1 and config.where("token_step") == "default"


def test_old_user_file_gets_new_options(user_file):
    user_file.parent.mkdir(parents=True)
    user_file.write_text("block_size: 64\n")  # written by an older version: few keys
    config = load_config()
    assert config.block_size == 64 and config.subgroup_size == 4


def test_unknown_key_names_closest_key_file_and_line(user_file):
    user_file.parent.mkdir(parents=True)
    user_file.write_text("block_size: 64\n\nsecond_selct_num: 8\n")
    with pytest.raises(ConfigError) as e:
        load_config()
    assert f"{user_file}:3" in str(e.value) and "did you mean 'second_select_num'" in str(e.value)



def test_a_removed_option_is_named_as_removed(user_file):
    user_file.parent.mkdir(parents=True)
    user_file.write_text("device_cache_blocks: 64\n")  # an option of earlier versions
    with pytest.raises(ConfigError) as e:
        load_config()
    assert str(e.value) == (f"Option 'device_cache_blocks' at {user_file}:1 no longer exists (the GPU reads the "
                            "selected blocks from DRAM itself (context_attention: gpu)); delete it.")
    user_file.write_text("cpu_stored_weights: true\ncpu_int4: true\n")  # a file written by the last version
    with pytest.raises(ConfigError, match=f"Option 'cpu_int4' at {user_file}:2 no longer exists .*cpu_stored_weights"):
        load_config()


@pytest.mark.parametrize("setting,expected", [
    ("block_size=100", "power of two"),
    ("block_size=8", "at least 16"),
    ("chunk_size=1000", "multiple of block_size"),
    ("second_select_num=-1", "at least 0"),
    ("anchor_type=BEST", "MAX, MEAN, QUEST, DYNAMIC, FIX"),
    ("kv_type=int3", "bf16, fp16, fp32, q8_0, q4_0"),
    ("rope_scaling=ntk", "auto, none, linear, yarn"),
    ("rope_scale=-2", "at least 0"),
    ("yarn_orig_ctx=-1", "at least 0"),
    ("alpha=1.5", "at most 1"),
    ("top_p=0", "above 0"),
    ("block_size=big", "must be an int"),
    ("preselect_block=3", "must be a bool"),
    ("device=tpu", "auto, cpu, cuda or cuda:N"),
])
def test_bad_values_name_the_allowed_values(user_file, setting, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        load_config(overrides=parse_set([setting]))
    assert f"--set {setting.split('=')[0]}" in str(e.value)


def test_set_needs_key_value_and_a_known_key():
    with pytest.raises(ConfigError, match="key=value"):
        parse_set(["block_size"])
    with pytest.raises(ConfigError, match="did you mean 'token_step'"):
        parse_set(["tokn_step=2"])


def test_invalid_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_size: 64\nchunk_size: [1,\n")
    with pytest.raises(ConfigError, match=f"{bad}:3"):
        read_yaml_options(bad)


def test_yaml_is_read_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("model: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml_options(evil)


def test_a_short_document_sits_in_the_local_window_whole(user_file):
    config = load_config(overrides=parse_set(["mode=long_context", "local_windows_len=8192",
                                              "max_seq_len=2065"]))
    assert config.local_window_for(config.check_against_model(num_layers=30, context_length=8192), 0) == 2065
    assert config.local_window_for(16384, 0) == 8192
    with pytest.raises(ConfigError, match="shorter than the model's sliding window"):
        config.local_window_for(2065, 16384)


def test_model_checks_run_before_weights(user_file):
    for key in ("dense_layer_num", "prefill_dense_layer_num"):
        config = load_config(overrides=parse_set([f"{key}=40"]))
        with pytest.raises(ConfigError, match=f"^{key} \\(40, from --set {key}\\) .* at most 30"):
            config.check_against_model(num_layers=30, context_length=8192)
    assert load_config().check_against_model(30, 8192) == 8192  # 0 means the model's length


def test_config_show_prints_value_and_source(user_file, capsys):
    from ktlong.config_command import main

    assert main(["show", "--set", "token_step=3"]) == 0
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("token_step "))
    assert "3" in row and "--set token_step" in row


def test_config_show_plan_prints_the_resolved_plan(user_file, capsys, smollm2_path):
    """The plan for the named model on this machine (the CPU here): every auto resolved, as
    local_chat prints it at start-up."""
    from ktlong.config_command import main
    from ktlong.kv.free_memory import available_dram_bytes

    assert main(["show", "--plan", "--model", "smollm2-135m", "--set", "max_seq_len=4096",
                 "--set", "kv_type=q8_0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SmolLM2-135M-Instruct.Q4_1.gguf: llama, 30 layers\n[plan for max_seq_len 4,096 on cpu")
    for text in ("KV cache: q8_0 in DRAM", "attention backend torch", "scored on the CPU", "read by the CPU operator",
                 "CUDA graphs off", "RAM for the KV cache"):
        assert text in out
    assert "auto" not in out and "beside decode steps" not in out  # SMs for a prefill beside decoding: GPUs only
    assert out.rstrip().endswith("[it fits this machine]")
    # caches hold what their conversations reach: 256 of max_seq_len fit where one does (the
    # server starts each request when its cache fits)
    assert main(["show", "--plan", "--model", "smollm2-135m", "--set", "max_seq_len=8192", "--max_num_seqs", "256",
                 "--set", "kv_type=fp32", "--set", "local_windows_len=8192"]) == 0
    out = capsys.readouterr().out
    assert "RAM decode window x256" in out and "up to 256 conversations a step" in out
    if 2 * 8192 * 30 * 2 * 3 * 64 * 4 < available_dram_bytes():  # one fp32 cache of 8K tokens: 0.35 GiB
        assert out.rstrip().endswith("[it fits this machine]")
    # a plan that cannot fit says so, with the refusal a session would give
    assert main(["show", "--plan", "--model", "smollm2-135m", "--set", "rope_scaling=yarn", "--set", "rope_scale=128",
                 "--set", "max_seq_len=1048576", "--set", "kv_type=fp32"]) == 0
    out = capsys.readouterr().out
    if 1048576 * 30 * 2 * 3 * 64 * 4 > available_dram_bytes():  # one fp32 cache of 1M tokens: 45 GiB
        assert "[it does not fit: The KV cache for max_seq_len 1,048,576 needs" in out
    assert main(["show", "--plan", "--model", "no-such-model"]) == 2


def test_local_chat_flags_map_to_options(user_file):
    import local_chat
    from ktlong.session.startup import overrides_from

    args = local_chat.build_parser().parse_args(
        ["--gguf_path", "m.gguf", "--cpu_infer", "2", "--use_cuda_graph", "--mode", "long_context",
         "--max_new_tokens", "7", "--set", "block_size=64"])
    config = load_config(overrides=overrides_from(args))
    assert (config.model, config.threads_num, config.use_cuda_graph, config.mode,
            config.max_new_tokens, config.block_size) == ("m.gguf", 2, True, "long_context", 7, 64)
    assert config.where("threads_num") == "--cpu_infer"


def test_help_shows_groups_and_defaults(capsys):
    import local_chat

    with pytest.raises(SystemExit):
        local_chat.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for text in ("model and machine:", "KV cache and sparse decode:", "generation:", "configuration:", "--cpu_infer",
                 "--set KEY=VALUE", "default: 512"):
        assert text in out


def test_config_dataclass_rejects_wrong_types_directly():
    values = {k: v for k, (v, _) in read_yaml_options(DEFAULT_FILE).items()}
    values["layer_step"] = True
    with pytest.raises(ConfigError, match="'layer_step' = True .* must be an int"):
        Config(**values)


@pytest.mark.parametrize("sets,needles", [
    (["temperature=.nan"], ["'temperature' = nan", "finite"]),
    (["top_p=.nan"], ["'top_p' = nan", "finite"]),
    (["seed=1180591620717411303424"], ["'seed'", "at most 9223372036854775807"]),
    (["threads_num=100000"], ["'threads_num' = 100000", "cores"]),
    (["api_key=[1, 2]"], ["'api_key' = (hidden)", "must be a str"]),
    (["cpu_engine=off"], ["'cpu_engine' = False", "must be one of auto, torch"]),  # YAML's off is false
])
def test_values_that_would_crash_or_leak_are_refused_in_one_sentence(user_file, sets, needles):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=parse_set(sets))
    message = str(e.value)
    assert "\n" not in message and "[1, 2]" not in message
    for needle in needles:
        assert needle in message, message


def test_yaml_nesting_past_its_bound_and_a_key_given_twice_are_refused(tmp_path, user_file):
    deep = "[" * 5000 + "]" * 5000
    path = tmp_path / "deep.yaml"
    path.write_text(f"temperature: {deep}\n")
    with pytest.raises(ConfigError, match=f"{path}:1 is not valid YAML \\(it nests deeper than 8 levels\\)"):
        read_yaml_options(path)
    with pytest.raises(ConfigError, match="--set temperature: .* is not a YAML value"):
        parse_set([f"temperature={deep}"])
    twice = tmp_path / "twice.yaml"
    twice.write_text("temperature: 0.5\ntop_k: 3\ntemperature: 0.7\n")
    with pytest.raises(ConfigError, match=f"{twice}:3 .*the key 'temperature' is given twice"):
        load_config(str(twice), write_user_file=False)
    shallow = tmp_path / "ok.yaml"
    shallow.write_text("system_prompt: '[[[['\ntop_k: 3\n")
    assert load_config(str(shallow), write_user_file=False).top_k == 3


def test_a_set_value_that_is_not_yaml_is_one_sentence():
    with pytest.raises(ConfigError, match=r"--set system_prompt: '\[x' is not a YAML value"):
        parse_set(["system_prompt=[x"])


def test_config_files_that_are_not_text_or_hold_an_alias_bomb_are_refused_quickly(tmp_path, user_file):
    import time

    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00model: x")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(str(binary))
    # 9^8 strings by reference under one known key: formatting it whole took minutes and gigabytes
    levels = ['&a ["xxxxxxxx","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefg", "bcdefgh"):
        levels.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("system_prompt: [" + ", ".join(levels) + "]\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="'system_prompt' = .* must be a str") as e:
        load_config(str(bomb))
    assert time.perf_counter() - start < 5 and len(str(e.value)) < 400


@pytest.mark.parametrize("argv,needle", [
    (["--gguf_path", "a.gguf", "--model", "smollm2-135m"], "--gguf_path and --model each name the model"),
    (["--model_path", "/nonexistent/folder"], "is not a folder holding a .gguf file"),
])
def test_model_flags_that_disagree_or_point_nowhere_are_refused(user_file, argv, needle):
    import local_chat
    from ktlong.session.startup import overrides_from

    with pytest.raises(ConfigError, match=needle):
        overrides_from(local_chat.build_parser().parse_args(argv))


def test_model_path_names_the_gguf_in_its_folder(tmp_path, user_file):
    import local_chat
    from ktlong.session.startup import overrides_from

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    overrides = overrides_from(local_chat.build_parser().parse_args(["--model_path", str(tmp_path)]))
    assert overrides["model"] == (str(tmp_path / "model.gguf"), "--model_path")


def test_engine_settings_take_options_by_name_and_type():
    """CompactParams (operators/, which imports nothing of ktlong) and SelectionSettings name the
    options they take; each field is an option of the same type, so they cannot drift."""
    import dataclasses

    from ktlong.decode.selection import SelectionSettings
    from operators.compact_attention import CompactParams

    for settings in (CompactParams, SelectionSettings):
        for f in dataclasses.fields(settings):
            assert f.name in OPTIONS and f.type == OPTIONS[f.name].type, (settings.__name__, f.name)

from pathlib import Path

import pytest

from tiered_kv.config import Config, ConfigError, env_table, from_env, parse_size


@pytest.mark.parametrize(
    "text,value",
    [
        ("1024", 1024),
        ("8GiB", 8 * 1024**3),
        ("512MB", 512 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("4 kib", 4096),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_defaults_without_env():
    c = from_env({})
    assert c == Config()
    assert c.memory_threshold == 0.85 and c.block_tokens == 256 and c.tiers == ("hot", "cold")


def test_values_from_env(tmp_path):
    c = from_env(
        {
            "TIERED_KV_DIR": str(tmp_path),
            "TIERED_KV_HOT_BYTES": "8GiB",
            "TIERED_KV_TIERS": "cold",
            "TIERED_KV_WRITE_THROUGH": "yes",
            "TIERED_KV_PREFETCH": "2GiB",
        }
    )
    assert c.cache_dir == Path(tmp_path) and c.hot_bytes == 8 * 1024**3
    assert c.tiers == ("cold",) and c.write_through and c.prefetch_bytes == 2 * 1024**3
    assert from_env({"TIERED_KV_PREFETCH": "3"}).prefetch_entries == 3
    assert from_env({"TIERED_KV_TIERS": "none"}).tiers == ()
    batch = from_env({"TIERED_KV_MAX_BATCH": "4", "TIERED_KV_MAX_QUEUE": "0"})
    assert (batch.max_batch, batch.max_queue) == (4, 0)
    assert (Config().max_batch, Config().max_queue) == (8, 64)


@pytest.mark.parametrize(
    "name,value",
    [
        ("TIERED_KV_HOT_BYTES", "lots"),
        ("TIERED_KV_MEMORY_THRESHOLD", "1.5"),
        ("TIERED_KV_BLOCK_TOKENS", "0"),
        ("TIERED_KV_TIERS", "warm"),
        ("TIERED_KV_WRITE_THROUGH", "maybe"),
        ("TIERED_KV_KV_BITS", "3"),
        ("TIERED_KV_PREFETCH", "-1"),
        ("TIERED_KV_DISK_BYTES", "-5GB"),
        ("TIERED_KV_MAX_BATCH", "0"),
        ("TIERED_KV_MAX_QUEUE", "-1"),
        ("TIERED_KV_TYPO", "1"),
        ("TIERED_KV_CHAT_TEMPLATE_ARGS", "enable_thinking=false"),
        ("TIERED_KV_CHAT_TEMPLATE_ARGS", "[1]"),
        ("TIERED_KV_DISK_BYTES", "1" + "0" * 400),  # was an OverflowError traceback
        ("TIERED_KV_PREFETCH", "1e400"),
        ("TIERED_KV_ALLOWED_ORIGINS", "localhost:3000"),
        ("TIERED_KV_ALLOWED_ORIGINS", "http://localhost:3000/"),
        ("TIERED_KV_ALLOWED_ORIGINS", "http://a.example,,http://b.example"),
    ],
)
def test_bad_value_names_the_variable(name, value):
    with pytest.raises(ConfigError) as e:
        from_env({name: value})
    assert name in str(e.value) and "\n" not in str(e.value)


def test_env_table_lists_every_variable():
    names = {row[0] for row in env_table()}
    assert "TIERED_KV_DIR" in names and "TIERED_KV_PREFETCH" in names and len(names) >= 17


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "redis://cache", "rediss://:pw@cache.lan:6380/3",
     "redis://user:p%40ss@10.0.0.2/1"],
)  # fmt: skip
def test_shared_url_accepted(url):
    c = from_env({"TIERED_KV_SHARED": url})
    assert c.shared_url == url and c.shared_enabled
    assert url not in repr(c)  # may hold a password: kept out of repr
    assert not from_env({"TIERED_KV_SHARED": url, "TIERED_KV_TIERS": "hot"}).shared_enabled


@pytest.mark.parametrize(
    "url",
    ["http://cache:6379", "redis://", "redis://h:notaport", "redis://h:70000",
     "redis://h/x", "redis://h/0?db=1", "cache:6379"],
)  # fmt: skip
def test_shared_url_refused_without_echoing_it(url):
    with pytest.raises(ConfigError) as e:
        from_env({"TIERED_KV_SHARED": url.replace("h", "u:secret@h", 1) if "//h" in url else url})
    assert "TIERED_KV_SHARED" in str(e.value) and "secret" not in str(e.value)


def test_shared_off_by_default():
    c = from_env({})
    assert c.shared_url == "" and not c.shared_enabled and c.shared_timeout == 1.0


def test_restore_mode():
    assert from_env({}).restore == "auto"
    assert from_env({"TIERED_KV_RESTORE": " Compute "}).restore == "compute"
    with pytest.raises(ConfigError, match="TIERED_KV_RESTORE"):
        from_env({"TIERED_KV_RESTORE": "fastest"})


def test_shared_prefill_switch():
    assert from_env({}).shared_prefill == "off"
    assert from_env({"TIERED_KV_SHARED_PREFILL": " OFF "}).shared_prefill == "off"
    with pytest.raises(ConfigError, match="TIERED_KV_SHARED_PREFILL"):
        from_env({"TIERED_KV_SHARED_PREFILL": "maybe"})


def test_chat_template_args_are_a_json_object():
    assert Config().chat_template_args == ""
    got = from_env({"TIERED_KV_CHAT_TEMPLATE_ARGS": ' { "enable_thinking" : false } '})
    assert got.chat_template_args == '{"enable_thinking":false}'


def test_allowed_origins():
    assert Config().allowed_origins == ("local",)  # pages of this machine (http_edge.LOCAL_ORIGINS)
    assert from_env({"TIERED_KV_ALLOWED_ORIGINS": "Local, https://chat.example.com"}).allowed_origins == (
        "local", "https://chat.example.com")  # fmt: skip
    got = from_env({"TIERED_KV_ALLOWED_ORIGINS": " http://localhost:3000, https://chat.example.com "})
    assert got.allowed_origins == ("http://localhost:3000", "https://chat.example.com")
    assert from_env({"TIERED_KV_ALLOWED_ORIGINS": "none"}).allowed_origins == ()
    assert from_env({"TIERED_KV_ALLOWED_ORIGINS": "tauri://localhost,*"}).allowed_origins == ("*",)

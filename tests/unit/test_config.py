"""Settings precedence (argv > CACHECD_* > setup's record > TOML > defaults) and validation
messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachecd import constants
from cachecd.config import load_settings, parse_size, recorded_path
from cachecd.errors import ConfigInvalid
from cachecd.sizes import format_size


def test_precedence_argv_env_toml_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('budget = "1GiB"\npolicy = "lru"\nsocket = "/tmp/from-toml.sock"\n')
    env = {"CACHECD_BUDGET": "2GiB", "CACHECD_SOCKET": "/tmp/from-env.sock"}
    s = load_settings({"socket": "/tmp/from-argv.sock"}, environ=env, config_file=toml)
    assert s.socket == Path("/tmp/from-argv.sock")  # argv wins
    assert s.budget == 2 * 1024**3  # env beats TOML
    assert s.policy == "lru"  # TOML beats the default
    assert s.max_parallel == constants.MAX_PARALLEL_FETCHES  # the default
    assert s.data_socket == Path("/tmp/from-argv.sock.data")


def test_setups_record_sits_between_env_and_toml_for_its_own_socket(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('endpoint = "http://toml:1"\npolicy = "lru"\nbudget = "1GiB"\n')
    sock = tmp_path / "s.sock"
    recorded_path(toml, sock).write_text('endpoint = "http://recorded:2"\nbudget = 3\n'
                                         'peers = ["http://peer:3"]\n')
    s = load_settings({"socket": str(sock)}, environ={}, config_file=toml)
    assert (s.endpoint, s.budget, s.peers) == ("http://recorded:2", 3, ["http://peer:3"])
    assert s.policy == "lru"  # what the record does not hold comes from the TOML file
    env = {"CACHECD_ENDPOINT": "http://env:4"}
    assert load_settings({"socket": str(sock)}, environ=env, config_file=toml).endpoint == \
        "http://env:4"
    assert load_settings({"socket": str(sock), "endpoint": "http://argv:5"}, environ=env,
                         config_file=toml).endpoint == "http://argv:5"
    # Another daemon's socket has a record of its own (none here).
    other = load_settings({"socket": str(tmp_path / "t.sock")}, environ={}, config_file=toml)
    assert other.endpoint == "http://toml:1"
    recorded_path(toml, sock).write_text('policy = "lru"\n')
    with pytest.raises(ConfigInvalid, match="policy cannot be recorded there"):
        load_settings({"socket": str(sock)}, environ={}, config_file=toml)


def test_cache_dirs_from_env_and_models_dir_follows(tmp_path: Path) -> None:
    a, b = tmp_path / "ssd1" / "experts", tmp_path / "ssd2"
    s = load_settings({}, environ={"CACHECD_CACHE_DIRS": f"{a}:{b}"}, config_file=tmp_path / "none")
    assert s.cache_dirs == [a, b]
    assert s.models_dir == a.parent / "models"


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("16MiB", 16 << 20), ("2G", 2 * 1000**3), ("1.5TB", int(1.5 * 1000**4)), (512, 512)],
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


def test_bad_values_name_the_key_and_origin(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match=r"CACHECD_BUDGET.*lots"):
        load_settings({}, environ={"CACHECD_BUDGET": "lots"}, config_file=tmp_path / "none")
    with pytest.raises(ConfigInvalid, match="--policy: 'fifo' is not one of"):
        load_settings({"policy": "fifo"}, environ={}, config_file=tmp_path / "none")
    toml = tmp_path / "bad.toml"
    toml.write_text("bugdet = 5\n")
    with pytest.raises(ConfigInvalid, match=r"bad.toml: unknown key\(s\) bugdet"):
        load_settings({}, environ={}, config_file=toml)
    toml.write_text("budget = [\n")
    with pytest.raises(ConfigInvalid, match="cannot read the config file"):
        load_settings({}, environ={}, config_file=toml)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(17_547_264) == "16.7 MiB"


def test_scrub_rate_from_each_layer_and_off(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('scrub_rate = "1MiB"\n')
    none = tmp_path / "none"
    assert load_settings({}, environ={}, config_file=none).scrub_rate == constants.DEFAULT_SCRUB_RATE
    assert load_settings({}, environ={}, config_file=toml).scrub_rate == 1 << 20
    env = {"CACHECD_SCRUB_RATE": "8MiB/s"}
    assert load_settings({}, environ=env, config_file=toml).scrub_rate == 8 << 20
    assert load_settings({"scrub_rate": "0"}, environ=env, config_file=toml).scrub_rate == 0
    with pytest.raises(ConfigInvalid, match=r"--scrub-rate: cannot read 'fast'"):
        load_settings({"scrub_rate": "fast"}, environ={}, config_file=none)
    with pytest.raises(ConfigInvalid, match=r"CACHECD_SCRUB_RATE: cannot read .-1."):
        load_settings({}, environ={"CACHECD_SCRUB_RATE": "-1"}, config_file=none)

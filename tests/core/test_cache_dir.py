"""ember.core.cache_dir: the one place Ember's cache directory is resolved."""

from ember.core.cache_dir import ember_cache_dir


def test_the_argument_wins_then_ember_cache_then_the_home_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EMBER_CACHE", raising=False)
    assert ember_cache_dir() == tmp_path / "home" / ".cache" / "ember"
    monkeypatch.setenv("EMBER_CACHE", "")  # set but empty: as if unset
    assert ember_cache_dir() == tmp_path / "home" / ".cache" / "ember"
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "env"))
    assert ember_cache_dir() == tmp_path / "env"
    assert ember_cache_dir(tmp_path / "given") == tmp_path / "given"
    assert ember_cache_dir(str(tmp_path / "given")) == tmp_path / "given"
    # A quoted "~/..." in a shell or .env file reaches the process unexpanded; it meant the home.
    monkeypatch.setenv("EMBER_CACHE", "~/scratch")
    assert ember_cache_dir() == tmp_path / "home" / "scratch"
    assert ember_cache_dir("~/given") == tmp_path / "home" / "given"

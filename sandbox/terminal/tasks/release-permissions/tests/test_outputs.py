import os
import stat


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_key_owner_only():
    assert mode("/app/private/key.pem") == 0o600
    assert open("/app/private/key.pem").read() == "KEY\n"


def test_public_modes():
    for top, dirs, files in os.walk("/app/public"):
        assert mode(top) == 0o755, top
        for name in files:
            assert mode(os.path.join(top, name)) == 0o644, name
    assert sorted(os.listdir("/app/public")) == ["css", "index.html", "js"]


def test_current_points_at_v2():
    assert os.path.islink("/app/current")
    assert os.readlink("/app/current").rstrip("/") in ("/app/releases/v2", "releases/v2")

import os
import shutil
import subprocess


def test_working_directory():
    assert os.getcwd() == "/srv/app"


def test_app_mode_exported():
    assert os.environ.get("APP_MODE") == "production"


def test_appctl_on_path_first():
    assert os.environ["PATH"].split(":")[0] == "/srv/app/bin"
    assert shutil.which("appctl") == "/srv/app/bin/appctl"
    out = subprocess.run(["appctl"], capture_output=True, text=True, timeout=10).stdout
    assert out.strip() == "appctl running in production mode"

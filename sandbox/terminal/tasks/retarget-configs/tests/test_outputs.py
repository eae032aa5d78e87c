from pathlib import Path

WANT = {
    "main.conf": "host=db.prod.internal\nport=5432\n",
    "services/api.conf": "# db.prod.internal is the old name\nurl=pg://db.prod.internal:5432/app\n",
    "services/worker.conf": "replica=db.prod.internal\nprimary=db.prod.internal\n",
}
UNCHANGED = {
    "old/notes.txt": "host=db.staging.internal\n",
    "old/backup.conf.bak": "host=db.staging.internal\n",
}


def test_conf_files_retargeted():
    for rel, text in WANT.items():
        assert Path("/app/conf", rel).read_text() == text, rel


def test_other_files_unchanged():
    for rel, text in UNCHANGED.items():
        assert Path("/app/conf", rel).read_text() == text, rel

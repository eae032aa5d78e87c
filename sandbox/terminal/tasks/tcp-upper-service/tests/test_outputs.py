import socket
import time


def talk(lines):
    last = None
    for _ in range(20):
        try:
            with socket.create_connection(("127.0.0.1", 9000), timeout=3) as s:
                f = s.makefile("rwb")
                out = []
                for line in lines:
                    f.write(line.encode() + b"\n")
                    f.flush()
                    out.append(f.readline().decode())
                return out
        except ConnectionRefusedError as e:
            last = e
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:9000: {last}")


def test_one_line():
    assert talk(["hello"]) == ["HELLO\n"]


def test_several_lines_and_clients():
    assert talk(["abc", "Mixed Case 123"]) == ["ABC\n", "MIXED CASE 123\n"]
    assert talk(["again"]) == ["AGAIN\n"]

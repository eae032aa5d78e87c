"""What a command run in a task box gave (`ExecResult`), and the capped buffer its output is
collected in (head and tail kept): the same for the docker and the bwrap backend."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExecResult:
    output: bytes          # stdout and stderr, interleaved, capped (head and tail kept)
    exit_code: int | None  # None when it was cut
    timed_out: bool
    truncated: bool
    duration_s: float

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


class CappedBuffer:
    """Keeps the first `head` bytes and the last `limit - head` bytes of a stream."""

    def __init__(self, limit: int, head: int | None = None):
        self.limit, self.head_limit = limit, min(limit, head if head is not None else limit // 4)
        self.head, self.tail = bytearray(), bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        over = len(self.tail) - (self.limit - self.head_limit)
        if over > 0:
            del self.tail[:over]
            self.dropped += over

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        return bytes(self.head) + f"\n[... {self.dropped} bytes left out ...]\n".encode() \
            + bytes(self.tail)

#!/bin/bash
cat > /app/upper_server.py <<'PY'
"""A line-based TCP service: answers each line in upper case."""
import socketserver


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line.rstrip(b"\r\n").upper() + b"\n")
            self.wfile.flush()


if __name__ == "__main__":
    socketserver.TCPServer.allow_reuse_address = True
    with socketserver.TCPServer(("127.0.0.1", 9000), Handler) as server:
        server.serve_forever()
PY
nohup python3 /app/upper_server.py >/tmp/upper.log 2>&1 &
for _ in $(seq 50); do
  python3 -c 'import socket; socket.create_connection(("127.0.0.1", 9000), 1).close()' \
    2>/dev/null && exit 0
  sleep 0.1
done
exit 1

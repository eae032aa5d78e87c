"""A line-based TCP service: answers each line in upper case. TODO: finish the handler."""
import socketserver


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        raise NotImplementedError


if __name__ == "__main__":
    with socketserver.TCPServer(("127.0.0.1", 9000), Handler) as server:
        server.serve_forever()

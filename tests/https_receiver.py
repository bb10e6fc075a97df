"""An HTTPS receiver for the webhook TLS tests (tests/it/webhook_tls.rs).

Usage: https_receiver.py CERT KEY. Listens on 127.0.0.1 (a free port), prints `READY <port>`,
then one line `REQ <method> <path> <authorization header or ->` per request, and answers
every request 204. Python's own ssl module: a TLS stack independent of the client's.
"""

import http.server
import ssl
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self):
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        print("REQ", self.command, self.path, flush=True)
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    do_POST = _answer
    do_PUT = _answer
    do_GET = _answer

    def log_message(self, *args):
        pass


def main():
    cert, key = sys.argv[1], sys.argv[2]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("READY", server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

"""A real SMTP server for outboxd's e-mail tests: aiosmtpd, with a handler that stores
every message it receives.

    python3 tests/smtp_sink.py DIR [--refuse ADDRESS]... [--fail-first N] [--fail-code CODE]

Listens on 127.0.0.1 on a free port and prints "READY <port>" once it accepts connections.
Each message whose content arrives (DATA) is written to DIR/<n>.json, atomically, with its
envelope, its raw bytes (base64), and what Python's own e-mail parser makes of it (decoded
headers and parts), so the tests check outboxd's bytes with code nobody here wrote. The
parse runs after the reply; DIR/<n>.pending is there until the record is written.

--refuse ADDRESS   answer RCPT TO for this address with 550 5.1.1.
--fail-first N     answer the content of the first N messages with --fail-code (default
                   451) instead of 250; the content is still recorded.
"""

import argparse
import asyncio
import base64
import email
import email.header
import email.policy
import email.utils
import json
import os
import re

from aiosmtpd.smtp import SMTP


class Sink:
    def __init__(self, directory, refuse, fail_first, fail_code):
        self.directory = directory
        self.refuse = {a.lower() for a in refuse}
        self.fail_first = fail_first
        self.fail_code = fail_code
        self.count = 0

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.lower() in self.refuse:
            return "550 5.1.1 <%s>: Recipient address rejected: User unknown" % address
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server, session, envelope):
        self.count += 1
        n = self.count
        raw = envelope.original_content or b""
        path = os.path.join(self.directory, "%04d.json" % n)
        # Parsing is the tests' analysis, not the relay's work, and a message with a
        # thousand recipients takes Python seconds of CPU (more on a loaded machine): it
        # runs in a thread after the reply, and DIR/<n>.pending says it has not ended.
        open(path + ".pending", "w").close()
        record = {
            "mail_from": envelope.mail_from,
            "rcpt_tos": list(envelope.rcpt_tos),
            "raw": base64.b64encode(raw).decode("ascii"),
        }
        asyncio.get_running_loop().run_in_executor(None, store, path, record, raw)
        if n <= self.fail_first:
            if self.fail_code.startswith("4"):
                return "%s 4.3.0 Try again later" % self.fail_code
            return "%s 5.6.0 Message refused" % self.fail_code
        return "250 2.0.0 Ok: queued as SINK%04d" % n


def store(path, record, raw):
    """Writes the record with what the parser makes of it, then clears the mark. Whatever
    fails, a record is written (with "error" in place of "parsed", which the tests report)
    and the mark cleared: the tests wait for it."""
    try:
        try:
            record["parsed"] = parse(raw)
            text = json.dumps(record)
        except Exception as e:
            record.pop("parsed", None)
            record["error"] = "the sink could not parse or store the message: %r" % (e,)
            text = json.dumps(record)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.rename(path + ".tmp", path)
    finally:
        os.remove(path + ".pending")


def parse(raw):
    """Decoded headers and leaf parts, as Python's e-mail package reads them."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    headers = [[name, str(email.header.make_header(email.header.decode_header(value)))]
               for name, value in msg.raw_items()]
    parts = []
    for part in msg.walk():
        if part.is_multipart():
            continue
        parts.append({
            "content_type": part.get_content_type(),
            "charset": part.get_content_charset(),
            "content": part.get_content(),
        })
    # The same headers through the policy's own header classes: values unfolded and
    # decoded per RFC 5322 and RFC 2047.
    decoded = [[name, str(value)] for name, value in msg.items()]
    # The address lists as (display name, address). Not through the policy's address
    # parser: in a display name it joins adjacent encoded words with a space, where RFC
    # 2047 section 6.2 says the white space between them is ignored (Python 3.11), so a
    # long name split over several encoded words would come back with spaces added.
    # Instead: unfold, decode the encoded words per RFC 2047, then parse the addresses.
    addresses = {}
    for name, value in msg.raw_items():
        if name.lower() in ("from", "to", "cc", "reply-to"):
            unfolded = re.sub(r"\r?\n(?=[ \t])", "", str(value))
            text = str(email.header.make_header(email.header.decode_header(unfolded)))
            addresses[name.lower()] = [list(a) for a in email.utils.getaddresses([text])]
    return {"content_type": msg.get_content_type(), "headers": headers, "parts": parts,
            "decoded": decoded, "addresses": addresses}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--refuse", action="append", default=[])
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--fail-code", default="451")
    args = ap.parse_args()
    handler = Sink(args.directory, args.refuse, args.fail_first, args.fail_code)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="sink.test", enable_SMTPUTF8=True),
        host="127.0.0.1",
        port=0,
    )
    port = server.sockets[0].getsockname()[1]
    print("READY %d" % port, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())

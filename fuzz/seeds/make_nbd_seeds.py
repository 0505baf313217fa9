#!/usr/bin/env python3
"""Write the NBD seed corpora (fuzz/corpus/nbd_handshake, nbd_transmission)
and the LUKS2 recipe seeds (fuzz/corpus/luks2). Run from fuzz/."""
import os, struct
IHAVEOPT = 0x49484156454F5054
REQ = 0x25609513
def opt(o, data=b''): return struct.pack('>QII', IHAVEOPT, o, len(data)) + data
def go(name=b'vol', infos=()):
    return struct.pack('>I', len(name)) + name + struct.pack('>H', len(infos)) + b''.join(struct.pack('>H', i) for i in infos)
def req(cmd, off=0, length=0, flags=0, cookie=1): return struct.pack('>IHHQQI', REQ, flags, cmd, cookie, off, length)
def wr(d, name, b):
    os.makedirs(f'corpus/{d}', exist_ok=True)
    open(f'corpus/{d}/{name}', 'wb').write(b)
F = struct.pack('>I', 3)
hs = {
    'go-disc': F + opt(7, go()) + req(2),
    'list-info-go': F + opt(3) + opt(6, go(b'vol', (0, 1, 2, 3))) + opt(7, go(b'', (3,))) + req(0, 0, 512),
    'export-name': struct.pack('>I', 1) + opt(1, b'vol') + req(2),
    'unsupported': F + opt(8) + opt(5) + opt(99, b'xyz') + opt(6, go(b'nope')) + opt(2),
    'too-big': F + struct.pack('>QII', IHAVEOPT, 6, 70000) + b'\0' * 64,
    'bad-flags': struct.pack('>I', 0xff) + opt(7, go()),
}
for k, v in hs.items(): wr('nbd_handshake', k, v)
pay = bytes(range(256)) * 2
tx = {
    'read': req(0, 0, 512) + req(2),
    'write-read': req(1, 4096, 512, cookie=7) + pay + req(0, 4096, 512, cookie=8) + req(3) + req(2),
    'write-fua-big': req(1, 0, 8192, flags=1) + pay * 16 + req(2),
    'trim-zeroes': req(4, 0, 4096) + req(6, 8192, 65536, flags=1 | 2) + req(6, 0, 512, flags=16),
    'read-max': req(0, 0, 65536) + req(0, (1 << 20) - 512, 1024) + req(0, 1 << 63, 512),
    'bad': req(1, 0, 1 << 30) + req(9, 0, 512) + req(0, 1, 511) + b'\x00' * 28,
    'bad-magic': b'\x25\x60\x95\x14' + b'\0' * 24,
}
for k, v in tx.items(): wr('nbd_transmission', k, v)
# LUKS2 recipes: byte 0 picks the base (bit 7: raw-JSON mode).
for i, n in enumerate(['l2-pbkdf2', 'l2-argon2id']):
    js = open(f'seeds/{n}.json', 'rb').read()
    wr('luks2', f'recipe-base{i}', bytes([i]))
    wr('luks2', f'raw-json-base{i}', bytes([0x80 | i, 0]) + js)
    wr('luks2', f'raw-json-secondary-newer{i}', bytes([0x80 | i, 4]) + js)
# A few edits: opcode, u16 node index, operands (see fuzz_targets/luks2.rs).
wr('luks2', 'recipe-edits', bytes([0, 0, 3, 0, 2, 7, 0]) + bytes([2, 9, 0, 5]) + bytes([9, 1, 0, 0, 3]))

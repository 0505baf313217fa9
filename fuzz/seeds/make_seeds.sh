#!/usr/bin/env bash
# Regenerate the LUKS seed images and corpora (fuzz/seeds/*.img,
# fuzz/corpus/luks1/*, fuzz/corpus/luks2/*). Needs cryptsetup (2.6 was
# used) and python3 with `cryptography`. Passphrase of every image: "fuzz".
# Images are cut after the last byte the header points at (keyslot 0's
# material), so seeds stay small: opening never reads the payload.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fuzz=$(dirname "$here")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mk() {
    local out=$1
    shift
    truncate -s 20M "$tmp/$out"
    printf fuzz | cryptsetup luksFormat --batch-mode --key-file=- "$@" "$tmp/$out" 2>/dev/null
}
mk l1-sha256 --type luks1 --cipher aes-xts-plain64 --key-size 256 --hash sha256 --pbkdf-force-iterations 1000
mk l1-sha1-512 --type luks1 --cipher aes-xts-plain64 --key-size 512 --hash sha1 --pbkdf-force-iterations 1000
mk l2-pbkdf2 --type luks2 --cipher aes-xts-plain64 --key-size 256 --hash sha256 --pbkdf pbkdf2 \
    --pbkdf-force-iterations 1000 --luks2-metadata-size 16k --luks2-keyslots-size 128k --offset 320 --label fuzz
mk l2-argon2id --type luks2 --cipher aes-xts-plain64 --key-size 256 --pbkdf argon2id \
    --pbkdf-force-iterations 4 --pbkdf-memory 32 --pbkdf-parallel 1 \
    --luks2-metadata-size 16k --luks2-keyslots-size 128k --offset 320 --sector-size 4096
printf fuzz | cryptsetup luksDump --dump-volume-key --batch-mode --key-file=- "$tmp/l1-sha256" \
    | sed -n '/MK dump:/,$p' | sed 's/MK dump://' | tr -dc '0-9a-f' > "$tmp/l1-sha256.mk"
python3 - "$tmp" "$here" "$fuzz/corpus" <<'PY'
import hashlib, json, os, struct, sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
tmp, seeds, corpus = sys.argv[1:4]
def rd(n): return open(os.path.join(tmp, n), 'rb').read()
def wr(path, b):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, 'wb').write(b)
# LUKS1: cut after keyslot 0's material (sector 8 + stripes*keybytes).
for name in ['l1-sha256', 'l1-sha1-512']:
    img = rd(name)
    kb = struct.unpack('>I', img[108:112])[0]
    end = 4096 + ((4000 * kb + 511) // 512) * 512
    wr(f'{corpus}/luks1/{name}', img[:end])
# LUKS1 with one AF stripe (re-sealed by hand): 4.5 KiB and opens with "fuzz".
img = bytearray(rd('l1-sha256')[:4096 + 512])
mk = bytes.fromhex(open(os.path.join(tmp, 'l1-sha256.mk')).read())
assert len(mk) == 32
slot = 208
it = struct.unpack('>I', img[slot + 4:slot + 8])[0]
salt = bytes(img[slot + 8:slot + 40])
struct.pack_into('>I', img, slot + 44, 1)  # stripes = 1: the AF material is the key
key = hashlib.pbkdf2_hmac('sha256', b'fuzz', salt, it, 32)
enc = Cipher(algorithms.AES(key), modes.XTS(bytes(16))).encryptor()
img[4096:4608] = enc.update(mk + bytes(480)) + enc.finalize()
wr(f'{corpus}/luks1/l1-one-stripe', bytes(img))
wr(f'{corpus}/luks1/l1-header-only', bytes(img[:592]))
# LUKS2: cut at the data offset (both header copies + the keyslot area).
for name in ['l2-pbkdf2', 'l2-argon2id']:
    img = rd(name)
    hdr = struct.unpack('>Q', img[8:16])[0]
    js = img[4096:hdr].split(b'\0', 1)[0]
    off = int(json.loads(js)['segments']['0']['offset'])
    wr(f'{seeds}/{name}.img', img[:off])
    wr(f'{seeds}/{name}.json', js)
PY
echo "seeds written"

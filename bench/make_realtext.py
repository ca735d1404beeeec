"""Writes a JSONL of real English text found on any Debian system (the license texts and the
copyright, README and NEWS files under /usr/share/doc), cut into documents of up to 2 kB, for
`preprocess_data` and the GPU pretraining check (bench/pretrain_gpu_check.sh):

    python3 bench/make_realtext.py /tmp/realtext.jsonl
    cargo run --release --example preprocess_data -- --input /tmp/realtext.jsonl \
        --output-prefix .gpu/data/realtext
"""
import glob
import gzip
import json
import sys


def documents():
    seen = set()
    paths = (sorted(glob.glob('/usr/share/common-licenses/*'))
             + sorted(glob.glob('/usr/share/doc/*/copyright'))
             + sorted(glob.glob('/usr/share/doc/*/README*'))
             + sorted(glob.glob('/usr/share/doc/*/NEWS*')))
    for path in paths:
        try:
            opener = gzip.open if path.endswith('.gz') else open
            with opener(path, 'rt', errors='ignore') as f:
                text = f.read().replace('\r', '')
        except OSError:
            continue
        if hash(text) in seen:
            continue
        seen.add(hash(text))
        yield from pack(p.strip() for p in text.split('\n\n'))


def pack(paragraphs):
    """Paragraphs of more than 40 characters joined into documents of up to 2 kB."""
    current = ''
    for paragraph in paragraphs:
        if len(paragraph) <= 40:
            continue
        if current and len(current) + len(paragraph) > 2000:
            yield current
            current = ''
        current += paragraph + '\n\n'
    if current:
        yield current


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else 'realtext.jsonl'
    count = chars = 0
    with open(out, 'w') as f:
        for doc in documents():
            f.write(json.dumps({'text': doc}) + '\n')
            count += 1
            chars += len(doc)
    print(f'{out}: {count} documents, {chars / 1e6:.1f} M characters')


if __name__ == '__main__':
    main()

"""Writes a JSONL of English text large enough that the 350M GPT's 1 000-step loss curve
(16.4 M byte tokens) never sees a document twice: the books shipped with a Rust toolchain
(The Rust Programming Language, the Reference, the Rustonomicon, Rust by Example, the Cargo,
rustc, Edition, Embedded and Style books, the error index) and the standard library's API
documentation, their HTML reduced to text; the manual pages, their roff reduced to text; the
Markdown files of the crates in Cargo's registry. Each paragraph once, cut into documents of
up to 2 kB, for `preprocess_data` (bytes as tokens) and the FP8 loss-curve check
(`PART=curvebook bash bench/fp8_gpu_check.sh`):

    python3 bench/make_booktext.py /tmp/booktext.jsonl 32000000
    cargo run --example preprocess_data -- --input /tmp/booktext.jsonl \
        --output-prefix .gpu/data/booktext

The toolchain's docs are found under `rustc --print sysroot`/share/doc/rust/html. The second
argument keeps a seeded random subset of the documents of about that many characters (all of
them without it: about 50 M on the development machine).
"""
import glob
import gzip
import html
import json
import os
import random
import re
import subprocess
import sys

from make_realtext import pack

BOOKS = ['book', 'reference', 'nomicon', 'rust-by-example', 'cargo', 'rustc', 'edition-guide',
         'embedded-book', 'style-guide', 'error_codes']
# mdBook's print pages repeat every chapter, and the tables of contents repeat on every page;
# the SIMD intrinsics' thousands of near-identical pages are left out.
SKIP = ('print.html', 'toc.html', '404.html', 'searchindex', '/arch/')


def text_of(page):
    """The page's main text: scripts, styles, navigation and tags removed, entities decoded."""
    main = re.search(r'<main[^>]*>(.*?)</main>', page, re.S)
    page = main.group(1) if main else page
    page = re.sub(r'<(script|style|nav)[^>]*>.*?</\1>', ' ', page, flags=re.S)
    page = re.sub(r'</(p|h[1-6]|li|pre|div|tr|blockquote)>', '\n\n', page)
    page = re.sub(r'<[^>]+>', '', page)
    page = html.unescape(page).replace('Expand description', '').replace('Copy item path', '')
    return re.sub(r'[ \t]+', ' ', page)


def roff_text(page):
    """A manual page's text: requests and comments dropped, font escapes removed."""
    lines = []
    for line in page.split('\n'):
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith('.'):
            line = re.sub(r'^\.(SH|SS|B|I|BR|IR|RB|RI|BI|IB)\s+', '', line)
            if line.startswith('.'):
                lines.append('')
                continue
        line = re.sub(r'\\f[BIRP]|\\f\(..|\\\(..|\\[&-]', '', line).replace('\\-', '-')
        lines.append(line.replace('"', ''))
    return '\n'.join(lines)


def texts(root):
    """Every source's text, one page or file at a time."""
    for book in BOOKS + ['std', 'core', 'alloc']:
        for path in sorted(glob.glob(os.path.join(root, book, '**', '*.html'), recursive=True)):
            if not any(s in path for s in SKIP):
                with open(path, errors='ignore') as f:
                    page = f.read()
                if 'Redirecting to' not in page[:2000]:
                    yield text_of(page)
    for path in sorted(glob.glob('/usr/share/man/man[1-8]/*.gz')):
        try:
            with gzip.open(path, 'rt', errors='ignore') as f:
                yield roff_text(f.read())
        except OSError:
            continue
    registry = os.path.expanduser('~/.cargo/registry/src')
    for path in sorted(glob.glob(os.path.join(registry, '*', '*', '**', '*.md'), recursive=True)):
        with open(path, errors='ignore') as f:
            yield f.read()


def documents(root):
    """Each text's paragraphs not seen before, packed as make_realtext.py packs them."""
    seen = set()
    for text in texts(root):
        fresh = []
        for paragraph in (p.strip() for p in text.replace('\r', '').split('\n\n')):
            if hash(paragraph) not in seen:
                seen.add(hash(paragraph))
                fresh.append(paragraph)
        yield from pack(fresh)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else 'booktext.jsonl'
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else None
    sysroot = subprocess.run(['rustc', '--print', 'sysroot'], capture_output=True, text=True,
                             check=True).stdout.strip()
    root = os.path.join(sysroot, 'share', 'doc', 'rust', 'html')
    docs = list(documents(root))
    if limit is not None:
        total = sum(len(d) for d in docs)
        rng = random.Random(1234)
        docs = [d for d in docs if rng.random() < limit / total]
    count = chars = 0
    with open(out, 'w') as f:
        for doc in docs:
            f.write(json.dumps({'text': doc}) + '\n')
            count += 1
            chars += len(doc)
    print(f'{out}: {count} documents, {chars / 1e6:.1f} M characters')


if __name__ == '__main__':
    main()

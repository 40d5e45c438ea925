"""llama-perplexity's multiple-choice modes (pyllamacpp.evaluation.llama_perplexity): task selection
against libstdc++ itself (a C++ program compiled here), glibc's expf and the float sums against C,
the three readers and the binary writer, the scores against each ending decoded alone, the
printed lines, the packing, the refusals, the CLI (and issue #29: progress and results on one
terminal). The comparison with llama-perplexity itself is opt-in, in test_scoring.py."""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import os
import platform
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp import scoring
from pyllamacpp.evaluation import _mc_float as F
from pyllamacpp.evaluation import _mc_random as R

mc = importlib.import_module("pyllamacpp.evaluation.llama_perplexity")
T = {"n_threads": 1, "n_threads_batch": 1}  # the machine is shared
# Against each ending decoded alone: flash attention on and ubatches of 32 tokens. At this pin, with
# flash attention off (any ubatch) or ubatches of 64 tokens and more, llama.cpp gives some sequences of
# a shared-prefix batch logits up to ~1.2 away from the same sequence alone (cf. llama.cpp#24962), and
# llama-perplexity, whose numbers these are, gets the same ones.
ON = {**T, "flash_attn": "on", "n_ubatch": 32}
DATA = Path(mc.__file__).resolve().parent.parent / "data"


# -- task selection: std::mt19937(1) and libstdc++'s uniform_int_distribution -------------------
SELECT_CPP = r"""
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
int main(int argc, char **argv) {
    size_t n = atol(argv[1]), k = atol(argv[2]);
    {   // hellaswag_score: a distribution over the tasks left, the task picked erased
        std::mt19937 rng(1);
        std::vector<size_t> left;
        for (size_t i = 0; i < n; ++i) left.push_back(i);
        for (size_t i = 0; i < k && !left.empty(); ++i) {
            std::uniform_int_distribution<size_t> dist(0, left.size() - 1);
            size_t j = dist(rng);
            printf("%zu ", left[j]);
            left.erase(left.begin() + j);
        }
        printf("\n");
    }
    {   // winogrande_score / multiple_choice_score
        std::mt19937 rng(1);
        std::vector<int> aux(n);
        for (size_t i = 0; i < n; ++i) aux[i] = i;
        float scale = 1.f / (1.f + (float)std::mt19937::max());
        for (size_t i = 0; i < k && !aux.empty(); ++i) {
            int j = (int)(scale * rng() * aux.size());
            printf("%d ", aux[j]);
            aux[j] = aux.back();
            aux.pop_back();
        }
        printf("\n");
    }
    {   // the raw engine, and wide ranges (one 32-bit draw, the 2^32-1 range, upscaling)
        std::mt19937 rng(1);
        for (int i = 0; i < 3; ++i) printf("%lu ", (unsigned long)rng());
        std::uniform_int_distribution<size_t> a(7, 7 + 4294967294ull), b(0, 4294967295ull), c(3, 10000000000ull);
        std::uniform_int_distribution<size_t> d(0, 3221225471ull);  // a quarter of the draws rejected
        std::uniform_int_distribution<size_t> e(0, 2147483648ull);  // 2^31 + 1: near half, any low word
        std::uniform_int_distribution<size_t> f(0, 8589934589ull);  // 2^33 - 3: high words from [0, 1]
        for (int i = 0; i < 3; ++i) {  // one statement each: argument evaluation order is unspecified
            size_t x = a(rng);
            size_t y = b(rng);
            size_t z = c(rng);
            printf("%zu %zu %zu ", x, y, z);
        }
        for (int i = 0; i < 20; ++i) printf("%zu ", d(rng));
        for (int i = 0; i < 20; ++i) printf("%zu ", e(rng));
        for (int i = 0; i < 20; ++i) printf("%zu ", f(rng));
        printf("\n");
    }
    {   // the default seed (the standard's check: its 10000th output is 4123659995), the widest seed,
        // and ranges where each step of the distribution shows
        std::mt19937 dflt, top(4294967295u), rng(1);
        for (int i = 1; i < 10000; ++i) dflt();
        printf("%lu %lu ", (unsigned long)dflt(), (unsigned long)top());
        std::uniform_int_distribution<size_t> g(0, 2147483647ull);  // 2^31: 2^32 % 2^31 is 0, nothing rejected
        std::uniform_int_distribution<size_t> h(5, 4294967300ull);  // the 2^32 - 1 range, from 5
        std::uniform_int_distribution<size_t> u(0, 6442450943ull);  // 3 * 2^31 - 1: high word 1, half its low words out
        std::uniform_int_distribution<size_t> v(0, 8589934591ull);  // 2^33 - 1: high words from [0, 1]
        std::uniform_int_distribution<size_t> w(0, 8589934592ull);  // 2^33: high words from [0, 2]
        for (int i = 0; i < 20; ++i) printf("%zu ", g(rng));
        for (int i = 0; i < 20; ++i) printf("%zu ", h(rng));
        for (int i = 0; i < 20; ++i) printf("%zu ", u(rng));
        for (int i = 0; i < 20; ++i) printf("%zu ", v(rng));
        for (int i = 0; i < 20; ++i) printf("%zu ", w(rng));
        printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def select_exe(tmp_path_factory) -> Path:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++: the libstdc++ check needs a C++ compiler")
    d = tmp_path_factory.mktemp("select")
    (d / "select.cpp").write_text(SELECT_CPP)
    subprocess.run([gxx, "-O2", "-std=c++17", "-o", str(d / "select"), str(d / "select.cpp")], check=True)
    return d / "select"


@pytest.mark.parametrize("n,k", [(10042, 400), (40, 40), (40, 400), (1, 1), (7, 3), (100, 99), (3000, 1500)])
def test_task_selection_is_libstdcxx(select_exe, n, k):
    out = subprocess.run([str(select_exe), str(n), str(k)], capture_output=True, text=True, check=True).stdout
    hs, rest, raw, more = out.split("\n")[:4]
    assert [int(v) for v in hs.split()] == R.hellaswag_order(n, k)
    assert [int(v) for v in rest.split()] == R.pick_without_replacement(n, min(k, n))
    rng = R.MT19937(1)
    mine = [rng() for _ in range(3)]
    for _ in range(3):
        mine += [
            R.uniform_int(rng, 7, 7 + 4294967294),
            R.uniform_int(rng, 0, 4294967295),
            R.uniform_int(rng, 3, 10**10),
        ]
    mine += [R.uniform_int(rng, 0, 3221225471) for _ in range(20)]  # low words only k * 2^30
    mine += [R.uniform_int(rng, 0, 2147483648) for _ in range(20)]  # low words below the threshold rejected
    mine += [R.uniform_int(rng, 0, 2**33 - 3) for _ in range(20)]  # upscaling: 2^33 - 3 // 2^32 is 1, not 2
    assert [int(v) for v in raw.split()] == mine
    dflt = R.MT19937()
    mine = [[dflt() for _ in range(10000)][-1], R.MT19937(2**32 - 1)()]
    assert mine[0] == 4123659995  # [rand.predef]: the 10000th output of a default-constructed std::mt19937
    rng = R.MT19937(1)
    for a, b in [(0, 2**31 - 1), (5, 5 + 2**32 - 1), (0, 3 * 2**31 - 1), (0, 2**33 - 1), (0, 2**33)]:
        mine += [R.uniform_int(rng, a, b) for _ in range(20)]
    assert [int(v) for v in more.split()] == mine


def test_selection_without_repeats_even_for_all_tasks():
    order = R.hellaswag_order(40, 400)
    assert sorted(order) == list(range(40)) and order != list(range(40))  # all of them, shuffled
    assert R.hellaswag_order(40, 5) == order[:5]  # the same draws, fewer of them
    assert sorted(R.pick_without_replacement(30, 30)) == list(range(30))


# -- llama-perplexity's float arithmetic ---------------------------------------------------------
def _libm():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("the expf rewritten is glibc's")
    return ctypes.CDLL("libm.so.6")


def test_expf_is_glibcs_bit_for_bit():
    f = _libm().expf
    f.argtypes, f.restype = [ctypes.c_float], ctypes.c_float
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            -rng.random(60000, dtype=np.float32) * np.float32(110),  # down past the underflow at -103.97
            -rng.random(30000, dtype=np.float32) * np.float32(2),
            -rng.random(10000, dtype=np.float32) * np.float32(1e-4),
            np.array([0.0, -0.0, -np.inf, -87.33654, -103.97207, -103.97208, -1e-45], np.float32),
            # the one float in [-103.97, 0] where r = z - kd without glibc's FMA rounds the result the other way
            np.array([float.fromhex("-0x1.f8cbb2p+5")], np.float32),
            # and one where the product's split into halves matters (a split of other halves rounds r otherwise)
            np.array([float.fromhex("-0x1.a420f4p+4")], np.float32),
        ]
    ).astype(np.float32)
    ref = np.array([f(float(v)) for v in x], np.float32)
    got = F.expf(x)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    exp_rounded = np.exp(x.astype(np.float64)).astype(np.float32)
    assert not np.array_equal(exp_rounded.view(np.uint32), ref.view(np.uint32))  # the double exp rounded is not it


def test_expf_table_is_2_to_the_i_over_32_correctly_rounded():
    """glibc's exp2f_data table: tab[i] + (i << 47) is the double nearest 2^(i/32). A one-ulp
    slip in an entry moves too few float results for the sampled comparison above to see."""
    from decimal import Decimal, localcontext

    with localcontext() as c:
        c.prec = 60
        for i in range(32):
            want = struct.unpack("<Q", struct.pack("<d", float(Decimal(2) ** (Decimal(i) / 32))))[0]
            assert int(F._T[i]) + (i << 47) == want, i


FLOAT_C = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
/* rows of n floats, then one int target per row, on stdin: compute_logprobs' value and softmax's
   log-probability of the target for each row, as perplexity.cpp computes them */
int main(int argc, char **argv) {
    int rows = atoi(argv[1]), n = atoi(argv[2]);
    float *x = malloc(sizeof(float) * n);
    int *t = malloc(sizeof(int) * rows);
    float *all = malloc(sizeof(float) * n * rows);
    if (fread(all, sizeof(float), (size_t)n * rows, stdin) != (size_t)n * rows) return 1;
    if (fread(t, sizeof(int), rows, stdin) != (size_t)rows) return 1;
    for (int r = 0; r < rows; ++r) {
        x = all + (size_t)r * n;
        float max_logit = x[0];
        for (int j = 1; j < n; ++j) max_logit = x[j] > max_logit ? x[j] : max_logit;
        float sum_p = 0.f;
        for (int j = 0; j < n; ++j) sum_p += expf(x[j] - max_logit);
        float lp = x[t[r]] - max_logit - logf(sum_p);
        double sum_exp = 0.0;
        for (int j = 0; j < n; ++j) { const float e = expf(x[j] - max_logit); sum_exp += e; }
        float p = expf(x[t[r]] - max_logit);
        p /= sum_exp;
        printf("%a %a\n", lp, logf(p));
    }
}
"""


def test_float_sums_are_perplexity_cpps(tmp_path, model):
    _libm()
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    (tmp_path / "f.c").write_text(FLOAT_C)
    subprocess.run([gcc, "-O2", "-o", str(tmp_path / "f"), str(tmp_path / "f.c"), "-lm"], check=True)
    with model.context(n_ctx=64, **T) as ctx:
        b = pl.Batch(16)
        b.add_sequence(model.tokenize("The quick brown fox jumps over the lazy dog."), 0, logits="all")
        ctx.decode(b)
        rows = np.array(ctx.logits_all())
    rng = np.random.default_rng(3)
    rows = np.concatenate([rows, (rng.standard_normal((4, rows.shape[1])) * 4).astype(np.float32)])
    targets = rng.integers(0, rows.shape[1], rows.shape[0]).astype(np.int32)
    out = subprocess.run(
        [str(tmp_path / "f"), str(rows.shape[0]), str(rows.shape[1])],
        input=rows.tobytes() + targets.tobytes(),
        capture_output=True,
        check=True,
    ).stdout.decode()
    ref = np.array([[float.fromhex(v) for v in line.split()] for line in out.splitlines()], np.float32)
    assert np.array_equal(F.eval_rows(rows, targets), ref[:, 0])
    assert rows.shape[0] % 4 and np.array_equal(F.eval_rows(rows, targets, chunk=4), ref[:, 0])  # passes, a short last
    assert np.array_equal([F.first_logprobs(r, np.array([t]))[0] for r, t in zip(rows, targets)], ref[:, 1])
    # and the float sum is not the exact one: double sums would print other digits
    d = rows[0] - rows[0].max()
    assert abs(float(np.cumsum(F.expf(d), dtype=np.float32)[-1]) - float(np.exp(d.astype(np.float64)).sum())) > 0


def test_c_format_prints_nan_as_glibc():
    assert F.c_format(F.NEG_NAN, "10.6") == "      -nan"
    assert F.c_format(math.nan, ".4") == "nan"
    assert F.c_format(-2.5674861, "10.6") == " -2.567486"


# -- the readers and the writer ------------------------------------------------------------------
def test_shipped_files_read_as_llama_perplexity_reads_them():
    hs = mc.read_hellaswag(mc.sample_path("hellaswag"))
    assert len(hs) == 40 and sorted({t.gold for t in hs}) == [0, 1, 2, 3]
    assert hs[1].line == 7 and hs[0].context.startswith("Making tea: ")
    wg, skipped = mc.read_winogrande(mc.sample_path("winogrande"))
    assert len(wg) == 40 and skipped == [] and wg[-1].line == 40  # the blank last line lets it read line 40
    quoted = wg[14]
    assert quoted.first == "Sara hired Beth to paint the house, so " and quoted.choices == ("Sara", "Beth")
    tasks = [
        mc.MultipleChoiceTask(d["question"], tuple(d["answers"]), tuple(d["labels"]))
        for d in map(json.loads, (DATA / "multiple_choice.jsonl").read_text().splitlines())
    ]
    assert mc.write_multiple_choice(tasks) == mc.sample_path("multiple-choice").read_bytes()
    back = mc.read_multiple_choice(mc.sample_path("multiple-choice"))
    assert [(t.question, t.answers, t.labels) for t in back] == [(t.question, t.answers, t.labels) for t in tasks]


def test_hellaswag_reader_refuses_the_wrong_format_naming_the_line(tmp_path):
    good = mc.sample_path("hellaswag").read_text()
    with pytest.raises(ValueError, match=r"241 lines, not a multiple of 6.*from line 241, has 1 line"):
        mc.read_hellaswag(good + "extra\n")
    bad = good.split("\n")
    bad[13] = "two"
    why = r"line 14: the gold ending's index must be 0, 1, 2 or 3, not 'two' \(the task starting at line 13;"
    with pytest.raises(ValueError, match=why):
        mc.read_hellaswag("\n".join(bad))
    with pytest.raises(ValueError, match=r"line 2: .*is this a HellaSwag file"):
        mc.read_hellaswag("0,A _ b.,x,y,1\n" * 6)  # a Winogrande CSV of 6 lines
    with pytest.raises(ValueError, match="no lines"):
        mc.read_hellaswag(b"\n")
    two = "\n".join(good.split("\n")[:12])  # two tasks, then a line: the third task's start named
    with pytest.raises(ValueError, match=r"13 lines, not a multiple of 6.*from line 13, has 1 line"):
        mc.read_hellaswag(two + "\nextra")
    with pytest.raises(ValueError, match=r"14 lines, not a multiple of 6.*from line 13, has 2 line"):
        mc.read_hellaswag(two + "\nextra\nmore")
    bad = two.split("\n")
    bad[7] = "4"  # the second task's gold line
    with pytest.raises(ValueError, match=r"line 8: the gold ending's index must be .* \(the task starting at line 7;"):
        mc.read_hellaswag("\n".join(bad))
    assert mc.read_hellaswag(good) == mc.read_hellaswag(good[:-1]) == mc.read_hellaswag(good + "\n")  # -f's newline
    crlf = mc.read_hellaswag(good.replace("\n", "\r\n"))
    assert crlf[0].context.endswith("\r") and crlf[0].gold == hs_gold0()  # \r kept, as std::getline keeps it


def test_hellaswag_reader_gives_each_line_its_field():
    # six lines a task: the context, the gold ending's index, the four endings; the task's first line
    text = "".join(f"ctx {t}\n{t % 4}\n" + "".join(f" end {t}.{e}\n" for e in range(4)) for t in range(3))
    assert mc.read_hellaswag(text) == [
        mc.HellaswagTask(f"ctx {t}", t % 4, tuple(f" end {t}.{e}" for e in range(4)), 6 * t + 1) for t in range(3)
    ]


def hs_gold0() -> int:
    return mc.read_hellaswag(mc.sample_path("hellaswag"))[0].gold


def test_winogrande_reader_as_load_winogrande_from_csv():
    text = (
        "0,Tom gave _ a book.,Ann,Bob,1\n"
        "1,no blank here,Ann,Bob,1\n"
        "2,a,b\n"
        '3,"He said, quietly, that _ won.",Ann,Bob,2\n'
        "4,_ ran.,Ann,Bob,3\n"
        "5,The _ barked.,dog,cat,1,extra\n"
        "6,Last _ line.,a,b,2"
    )
    tasks, skipped = mc.read_winogrande(text)
    assert [t.index for t in tasks] == ["0", "3", "5"]  # line 7 has no newline after it: not read
    assert tasks[1].first == "He said, quietly, that " and tasks[1].answer == 2
    assert tasks[2].choices == ("dog", "cat") and tasks[2].answer == 1  # `stream >> i_answer` stops at the comma
    assert skipped == [
        (2, "no _ in <no blank here>"),
        (3, "failed to find comma separators in <2,a,b>"),
        (5, "failed to parse answer <3>"),
    ]
    assert len(mc.read_winogrande(text + "\n")[0]) == 3  # -f drops that newline: still not read
    assert len(mc.read_winogrande(text + "\n\n")[0]) == 4
    with pytest.raises(ValueError, match=r"line 2: no _ in <no blank here>"):
        mc.read_winogrande(text, strict=True)
    with pytest.raises(ValueError, match=r"no tasks: line 1: failed to find comma separators"):
        mc.read_winogrande(mc.sample_path("hellaswag"))


def test_winogrande_reader_edge_lines():
    # a sentence, quoted or not, after an index of any width: both halves
    for index in ("7", "12", "1234"):
        ((t,), _) = mc.read_winogrande(f'{index},"He said, quietly, that _ won.",Ann,Bob,2\n\n')
        assert t == mc.WinograndeTask("He said, quietly, that ", " won.", ("Ann", "Bob"), 2, index, 1)
        ((t,), _) = mc.read_winogrande(f"{index},He said that _ won.,Ann,Bob,1\n\n")
        assert t == mc.WinograndeTask("He said that ", " won.", ("Ann", "Bob"), 1, index, 1)
    # a bad answer is quoted from after the fourth comma, wherever that comma lies
    for index in ("4", "14"):
        _, skipped = mc.read_winogrande(f"0,Tom _ ran.,a,b,1\n{index},_ ran.,Ann,Bob,3\n\n")
        assert skipped == [(2, "failed to parse answer <3>")]
    # a sentence that starts with a blank (a character below the quote) is not quoted
    ((t,), _) = mc.read_winogrande("3, Tom _ ran.,a,b,1\n\n")
    assert (t.first, t.second) == (" Tom ", " ran.")
    # the unread last line is named whole up to 60 characters, else by its first 57 and "..."
    for n in (60, 61):
        last = "9," + "x" * (n - 13) + " _ y.,a,b,1"
        assert len(last) == n
        with pytest.warns(pl.errors.TaskFileWarning) as w:
            mc.read_winogrande("1,Tom _ ran.,a,b,1\n2,Ann _ ran.,a,b,1\n" + last)  # the last line is the third
        assert str(w[0].message).endswith(f"<{last}>" if n == 60 else f"<{last[:57]}...>")
    # the keywords as documented: data by name or place, strict by name only
    assert mc.read_winogrande(data="0,Tom _ ran.,a,b,1\n\n")[0][0].first == "Tom "
    with pytest.raises(TypeError):
        mc.read_winogrande("0,Tom _ ran.,a,b,1\n\n", True)
    # an empty quoted sentence is empty (no blank in it), not its closing quote
    tasks, skipped = mc.read_winogrande('0,"",a,b,1\n1,Tom _ ran.,a,b,1\n\n')  # -f drops one newline
    assert [t.index for t in tasks] == ["1"] and skipped == [(1, "no _ in <>")]
    # no task at all: the first line skipped and its reason
    with pytest.raises(ValueError) as e:
        mc.read_winogrande("0,none,a,b,1\n1,a,b\n\n")
    assert str(e.value) == "Winogrande data: no tasks: line 1: no _ in <none>"
    # a long last line without newline: named by its first 57 characters
    last = "9,A very long sentence that goes on and on about _ and more.,a,b,1"
    assert len(last) > 60
    with pytest.warns(pl.errors.TaskFileWarning) as w:
        mc.read_winogrande("1,Tom _ ran.,a,b,1\n" + last)
    assert str(w[0].message).endswith(f"<{last[:57]}...>")


def test_multiple_choice_writer_refuses_a_file_past_its_u32_offsets(monkeypatch):
    # a task's bytes stood in for by their length (4 GiB is not made to test the check)
    from pyllamacpp.evaluation import _mc_data

    class Sized:
        def __init__(self, n):
            self.n = n

        def __add__(self, other):
            return Sized(self.n + len(other))

        def __len__(self):
            return self.n

    tasks = [mc.MultipleChoiceTask("Q one?", ("a", "bb"), (0, 1))]
    size = len(mc.write_multiple_choice(tasks))
    question = len(_mc_data._pack_string("Q one?"))
    real = _mc_data._pack_string
    for end in (2**32 - 1, 2**32, 2**32 + 1):  # where the file would end
        grown = end - size + question  # the question's bytes, grown to end the file there

        def pack(s, grown=grown):
            return Sized(grown) if s == "Q one?" else real(s)

        monkeypatch.setattr(_mc_data, "_pack_string", pack)
        if end < 2**32:
            with pytest.raises(TypeError):  # past the check: the join of the stand-in fails
                mc.write_multiple_choice(tasks)
        else:
            with pytest.raises(ValueError, match=f"^{end} bytes: the format's u32 offsets end at 4 GiB$"):
                mc.write_multiple_choice(tasks)


def test_multiple_choice_edges_of_the_format():
    # the task count: fewer than its 4 bytes, or 0, is "no tasks"; a count without its offsets is a short read
    for raw in (b"", b"\1\0\0", b"\0\0\0\0"):
        with pytest.raises(ValueError, match=r"^multiple-choice data: no tasks \(the file's first 4 bytes"):
            mc.read_multiple_choice(raw)
    with pytest.raises(ValueError, match="the 1 task offsets"):
        mc.read_multiple_choice(b"\1\0\0\0")
    # the writer: as many labels as answers, at most 100 answers (llama-perplexity's limit)
    for answers, labels in ((("a", "b"), (0, 1, 0)), (("a", "b", "c"), (0, 1))):
        with pytest.raises(ValueError, match=rf"task 0 \(mc1\): {len(answers)} answers but {len(labels)} labels"):
            mc.write_multiple_choice([mc.MultipleChoiceTask("Q?", answers, labels)])
    for bad in (mc.MultipleChoiceTask("", ("a", "b"), (0, 1)), mc.MultipleChoiceTask("Q?", (), ()),
                mc.MultipleChoiceTask("Q?", ("a", ""), (0, 1))):  # fmt: skip
        with pytest.raises(ValueError, match="task 1: an empty question, no answers or an empty answer"):
            mc.write_multiple_choice([mc.MultipleChoiceTask("Q?", ("a", "b"), (0, 1)), bad])
    many = tuple(f"a{i}" for i in range(300))  # counts past CPython's cached small ints
    with pytest.raises(ValueError, match=r"task 0 \(mc1\): 300 answers, more than the 100 llama-perplexity reads"):
        mc.write_multiple_choice([mc.MultipleChoiceTask("Q?", many, (1,) + (0,) * 299)])
    many = tuple(f"a{i}" for i in range(101))
    with pytest.raises(ValueError, match=r"task 0 \(mc1\): 101 answers, more than the 100 llama-perplexity reads"):
        mc.write_multiple_choice([mc.MultipleChoiceTask("Q?", many, (1,) + (0,) * 100)])


def test_multiple_choice_reader_and_writer():
    t = [
        mc.MultipleChoiceTask("Q one?", ("a", "bb"), (0, 1), ("x",), (1,)),
        mc.MultipleChoiceTask("Q two?", ("c", "d", "e"), (1, 0, 0)),
        mc.MultipleChoiceTask("Q three?", ("f",), (1,)),
    ]
    raw = mc.write_multiple_choice(t)
    n, *pos = struct.unpack_from("<4I", raw)
    assert n == 3 and pos[0] == 16
    back = mc.read_multiple_choice(raw)
    assert [b.offset for b in back] == pos
    assert [(b.question, b.answers, b.labels, b.mc2_answers, b.mc2_labels) for b in back] == [
        (x.question, x.answers, x.labels, x.mc2_answers, x.mc2_labels) for x in t
    ]
    assert [b.question for b in mc.read_multiple_choice(raw, [2, 0])] == ["Q three?", "Q one?"]
    # a selection is read at the table's offsets, all tasks one after the other (as there)
    swapped = raw[:4] + struct.pack("<3I", pos[1], pos[0], pos[2]) + raw[16:]
    assert mc.read_multiple_choice(swapped, [0])[0].question == "Q two?"
    assert mc.read_multiple_choice(swapped)[0].question == "Q one?"
    for bad in (-1, 3, 4):  # a selection is task numbers, not Python indexes: -1 is not the last task
        with pytest.raises(ValueError, match=f"task {bad} is outside the file's 3 tasks"):
            mc.read_multiple_choice(raw, [0, bad])
    with pytest.raises(ValueError, match=r"task 2 of 3: mc1's 1 labels at byte \d+: needs 4 bytes, 2 left"):
        mc.read_multiple_choice(raw[:-6])
    with pytest.raises(ValueError, match="no tasks"):
        mc.read_multiple_choice(b"\0\0\0\0")
    with pytest.raises(ValueError, match=r"the 3 task offsets at byte 4: needs 12 bytes, 4 left"):
        mc.read_multiple_choice(raw[:8])
    with pytest.raises(ValueError, match=r"task 0 of 3: the question's length at byte 16: needs 4 bytes, 0 left"):
        mc.read_multiple_choice(raw[:16])  # the offsets, then nothing
    past = raw[:4] + struct.pack("<3I", pos[0], len(raw) + 10, pos[2]) + raw[16:]  # an offset past the end
    at = len(raw) + 10
    said = rf"task 1 \(at the offset the table gives, {at}\): the question's length at byte {at}: needs 4 bytes, 0 left"
    with pytest.raises(ValueError, match=said + rf" \(file of {len(raw)} bytes\)"):
        mc.read_multiple_choice(past, [1])
    big = struct.pack("<II", 1, 8) + struct.pack("<I", 1) + b"q" + struct.pack("<I", 101)
    with pytest.raises(ValueError, match="101 answers, more than 100"):
        mc.read_multiple_choice(big)
    with pytest.raises(ValueError, match="empty answer"):
        mc.write_multiple_choice([mc.MultipleChoiceTask("Q?", ("a", ""), (1, 0))])
    with pytest.raises(ValueError, match="2 answers but 1 labels"):
        mc.write_multiple_choice([mc.MultipleChoiceTask("Q?", ("a", "b"), (1,))])
    assert mc.read_multiple_choice(raw + b"\n")[2].question == "Q three?"  # -f's trailing newline dropped


def test_a_winogrande_line_without_newline_is_dropped_and_said(model):
    # issue 36: 3 tasks in the file, 2 scored, nothing said; the reading stays llama-perplexity's
    import warnings

    from pyllamacpp.errors import TaskFileWarning

    text = "0,Tom gave _ a book.,Ann,Bob,1\n1,The cat chased the _.,dog,mouse,2\n2,Last _ line.,a,b,2"
    for data in (text, text + "\n", text.encode()):  # no newline, or only the one -f drops
        with pytest.warns(TaskFileWarning, match=r"line 3: not read.* no newline ends it.*<2,Last _ line\.,a,b,2>"):
            tasks, _ = mc.read_winogrande(data)
        assert [t.index for t in tasks] == ["0", "1"]
    with pytest.warns(TaskFileWarning, match="line 3: not read") as w:
        r = mc.winogrande(model, text, **T)
    assert r.n_tasks == 2 and w[0].filename == __file__  # at the caller's line, not the package's
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskFileWarning)
        assert len(mc.read_winogrande(text + "\n\n")[0]) == 3  # an empty last line: all read, nothing said
        mc.read_winogrande(mc.sample_path("winogrande"))
        mc.read_hellaswag(mc.sample_path("hellaswag"))  # getline without eof: HellaSwag loses no line
        mc.read_multiple_choice(mc.sample_path("multiple-choice"))


def test_multiple_choice_bytes_after_the_last_task_are_said():
    # the binary reader's own silent loss: a task count smaller than the tasks written
    import warnings

    from pyllamacpp.errors import TaskFileWarning

    t = [mc.MultipleChoiceTask("Q one?", ("a", "b"), (0, 1)), mc.MultipleChoiceTask("Q two?", ("c", "d"), (1, 0))]
    raw = mc.write_multiple_choice(t)
    one = mc.write_multiple_choice(t[:1])
    lost = one + raw[4 + 8 + len(one) - 8 :]  # a count of 1, then both tasks' bytes
    said = rf"{len(lost) - len(one)} byte\(s\) after the last of its 1 task\(s\) "
    said += rf"\(bytes {len(one)} to {len(lost)}\) are not read"
    with pytest.warns(TaskFileWarning, match=said):
        assert [x.question for x in mc.read_multiple_choice(lost)] == ["Q one?"]
    more = one + b"\0" * (len(one) + 5)  # more bytes after than before
    with pytest.warns(TaskFileWarning, match=rf"^multiple-choice data: {len(one) + 5} byte\(s\) after the last"):
        mc.read_multiple_choice(more)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskFileWarning)
        assert len(mc.read_multiple_choice(raw)) == 2
        assert mc.read_multiple_choice(lost, [0])[0].question == "Q one?"  # a selection reads at the offsets


# -- scoring, against each ending decoded alone ---------------------------------------------------
def alone_logprobs(model, ctx, tokens: np.ndarray) -> np.ndarray:
    """float64 log-softmax rows of a sequence decoded on its own (row i predicts token i + 1)."""
    ctx.memory.clear()
    b = pl.Batch(len(tokens))
    b.add_sequence(tokens, 0, logits="all")
    ctx.decode(b)
    x = np.array(ctx.logits_all(), np.float64)
    return x - (
        x.max(axis=1, keepdims=True) + np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))
    )


def mean_after(model, ctx, texts: list[str]) -> list[float]:
    seqs = [model.tokenize(t) for t in texts]
    n = min(len(s) for s in seqs)
    cp = next((k for k in range(n) if len({int(s[k]) for s in seqs}) > 1), n)
    out = []
    for s in seqs:
        lp = alone_logprobs(model, ctx, s)
        out.append(float(np.mean([lp[j, s[j + 1]] for j in range(cp - 1, len(s) - 1)])))
    return out


def test_hellaswag_scores_are_each_ending_decoded_alone(model):
    r = mc.hellaswag(model, None, 6, **ON)
    tasks = mc.read_hellaswag(mc.sample_path("hellaswag"))
    assert [t.task for t in r.tasks] == R.hellaswag_order(40, 6)
    with model.context(n_ctx=256, **ON) as ctx:
        for t in r.tasks:
            h = tasks[t.task]
            ref = mean_after(model, ctx, [h.context + " " + e for e in h.endings])
            assert np.max(np.abs(np.array(t.scores) - ref)) < 2e-4, (t, ref)
            assert t.pred == int(np.argmax(ref)) and t.gold == (h.gold,) and t.correct == (t.pred == h.gold)
    assert r.n_decodes == 6 and r.n_seq_max == 4 and r.n_ctx == 2048  # one task per batch at n_parallel 1


def test_hellaswag_report_is_llama_perplexitys_lines(model):
    seen: list[str] = []
    r = mc.hellaswag(model, None, 10, on_text=seen.append, **T)
    assert "".join(seen) == r.report() == r.text
    lines = r.report().split("\n")
    assert lines[:2] == ["", "task\tacc_norm\t95% confidence interval"] and lines[-2:] == ["", ""]
    n = 0
    for i, (t, line) in enumerate(zip(r.tasks, lines[2:12])):
        n += t.correct
        assert t.correct == (t.pred == t.gold[0])
        z = 1.95996398454**2 / (i + 1)
        freq = n / (i + 1)
        cnf = z * math.sqrt((i + 1) * (4 * freq * (1 - freq) + z)) / (2 * 1.95996398454)
        lo, hi = (freq + z / 2 - cnf) / (1 + z), (freq + z / 2 + cnf) / (1 + z)
        assert line == f"{i + 1}\t{100 * freq:.8f}%\t[{100 * lo:.4f}%, {100 * hi:.4f}%]"
    assert 1 < n < 10  # the running accuracy moves (n ** (i + 1) for n / (i + 1) passed with 4 tasks, none right)
    assert r.accuracy == n / 10 and r.interval == pytest.approx((lo, hi), abs=1e-12)


def test_packing_and_pieces_of_n_batch_give_the_same_scores(model):
    base = mc.hellaswag(model, None, 6, **ON)
    # 8 sequences: 2 tasks per batch; n_batch 16: every task straddles several decodes
    packed = mc.hellaswag(model, None, 6, n_parallel=8, n_batch=16, **ON)
    assert packed.n_seq_max == 8 and packed.n_decodes > 3 * 2
    assert [t.task for t in packed.tasks] == [t.task for t in base.tasks]
    for a, b in zip(base.tasks, packed.tasks):
        assert np.max(np.abs(np.array(a.scores) - b.scores)) < 2e-4
        assert a.pred == b.pred
    with model.context(n_ctx=2048, n_batch=2048, n_seq_max=4, kv_unified=True, **ON) as ctx:
        with_ctx = mc.hellaswag(ctx, None, 6)
    assert with_ctx.report() == base.report()


def test_hellaswag_takes_400_tasks_by_default_as_hellaswag_tasks_does(model, monkeypatch):
    """``--hellaswag-tasks`` defaults to 400: of a file of 401, 400 in llama-perplexity's random
    order (the tasks are picked before any decode; the decode is stopped here)."""
    text = "".join(f"Task {k}: a man\n0\nruns.\nwalks.\nsits.\nstands.\n" for k in range(401))
    picked: list[list[int]] = []

    class Stop(Exception):
        pass

    def spy(ctx, model, preps, *args):
        picked.append([int(p.what.split()[2]) for p in preps])
        raise Stop

    monkeypatch.setattr(mc, "_decode_groups", spy)
    for kw, n in (({}, 400), ({"n_tasks": 401}, 401)):
        with pytest.raises(Stop):
            mc.hellaswag(model, text, **kw, **T)
        assert picked[-1] == R.hellaswag_order(401, n)


def test_a_decode_that_begins_with_a_finished_tasks_last_token_scores_each_task_once(model, monkeypatch):
    """A task's last token predicts nothing (no row); cut alone into the next decode, before the
    next task's shared tokens, it is a piece without rows of a task whose rows are all out: skipped,
    not the task finished twice (8 sequences, n_batch 21: task 4's, seen in the batches)."""
    firsts: list[tuple] = []
    decode = pl.Context.decode

    def spy(ctx, batch, *args, **kwargs):
        firsts.append((bool(batch.logits[0]), int(batch.n_seq_id[0]), int(batch.seq_id[0, 0]), int(batch.n_seq_id[1])))
        return decode(ctx, batch, *args, **kwargs)

    base = mc.hellaswag(model, None, 8, n_parallel=8, **ON)
    monkeypatch.setattr(pl.Context, "decode", spy)
    cut = mc.hellaswag(model, None, 8, n_parallel=8, n_batch=21, **ON)
    # a decode whose first slot has no row, in the last ending (seq 3 or 7) of one task, the next
    # task's shared tokens (4 seq ids) after it
    assert any(not out and n == 1 and s % 4 == 3 and n1 == 4 for out, n, s, n1 in firsts)
    assert [t.task for t in cut.tasks] == [t.task for t in base.tasks]
    for a, b in zip(base.tasks, cut.tasks):
        assert np.max(np.abs(np.array(a.scores) - b.scores)) < 2e-4 and a.pred == b.pred


def test_each_decode_is_llama_perplexitys_batch_cut_every_n_batch(model, monkeypatch):
    """hellaswag_score's batch, slot for slot: per task its endings' shared tokens once, carrying
    every ending's seq id, a row at their last; then each ending's own tokens in its sequence, rows
    but at its last; the tasks of a batch one after the other; cut every n_batch tokens, the memory
    cleared between batches (8 sequences: tasks 0 and 1, then task 2)."""
    seen: list[tuple] = []
    decode = pl.Context.decode

    def spy(ctx, batch, *args, **kwargs):
        n = len(batch)
        ids = [tuple(batch.seq_id[i, : batch.n_seq_id[i]].tolist()) for i in range(n)]
        seen.append((batch.token.tolist(), batch.pos.tolist(), ids, batch.logits.astype(bool).tolist()))
        return decode(ctx, batch, *args, **kwargs)

    monkeypatch.setattr(pl.Context, "decode", spy)
    r = mc.hellaswag(model, None, 3, n_parallel=8, n_batch=16, **ON)
    tasks = mc.read_hellaswag(mc.sample_path("hellaswag"))
    want: list[list[tuple]] = []
    for group in ([0, 1], [2]):
        slots: list[tuple] = []
        for k, i in enumerate(group):
            h = tasks[r.tasks[i].task]
            seqs = [model.tokenize(h.context + " " + e, True, False).tolist() for e in h.endings]
            cp = 0
            while all(len(s) > cp and s[cp] == seqs[0][cp] for s in seqs):
                cp += 1
            ids = tuple(range(4 * k, 4 * k + 4))
            slots += [(t, j, ids, j == cp - 1) for j, t in enumerate(seqs[0][:cp])]
            for e, s in enumerate(seqs):
                slots += [(s[j], j, (4 * k + e,), j < len(s) - 1) for j in range(cp, len(s))]
        want += [slots[a : a + 16] for a in range(0, len(slots), 16)]
    got = [list(zip(*b)) for b in seen]
    assert [len(b) for b in got] == [len(b) for b in want]
    assert got == want


def test_wilson_interval_is_the_textbook_one():
    """hellaswag_score's interval, in its order of operations, is Wilson's 95% score interval:
    (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n). Counts away from 0 too: at 0 of n the
    low end is 0 whatever the denominator."""
    z = 1.95996398454
    for k, n in ((16, 40), (1, 4), (3, 4), (4, 4), (0, 7), (37, 400), (399, 400)):
        p = k / n
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        centre = p + z * z / (2 * n)
        want = ((centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n))
        assert mc.wilson_interval(k, n) == pytest.approx(want, abs=1e-12), (k, n)
    lo, hi = mc.wilson_interval(16, 40)  # the f16 row of the kv-types HellaSwag column: 26.3 to 55.4 %
    assert (round(100 * lo, 1), round(100 * hi, 1)) == (26.3, 55.4)


def _preps(required, n_seqs=4):
    return [mc._Prep([np.zeros(1, np.int32)] * n_seqs, 0, r, f"task {i}") for i, r in enumerate(required)]


@pytest.mark.parametrize(
    ("n_base", "said"),
    [
        ((3, 9), "choice 1's first part tokenizes to 3 tokens"),
        ((4, 9), "choice 1's first part tokenizes to 4 tokens"),  # its first row would be -1: the last
        ((9, 12), "choice 2's first part tokenizes to 12 tokens"),
    ],
)
def test_winogrande_refuses_a_choice_whose_first_part_would_index_outside_the_logits(n_base, said):
    # token counts no tokenizer gave here (first + choice shorter than the shared tokens, or longer
    # than its whole sentence), made by hand: refused with the choice named from 1, as the line says
    seqs = [np.arange(10, dtype=np.int32), np.concatenate([np.arange(5), np.arange(20, 26)]).astype(np.int32)]
    p = mc._Prep(seqs, 5, 16, "Winogrande task 0 (line 1)", n_base)
    with pytest.raises(ValueError, match=rf"^Winogrande task 0 \(line 1\): {said}, against 5 shared"):
        mc._winogrande_pairs(p)


def test_winogrande_scores_after_the_choice_word_from_4_tokens_past_the_shared_ones():
    # llama-perplexity's skip_choice: more than k_min_trailing_ctx (3) tokens after the shared part
    # in both sentences, 4 and 4 here: each choice is scored from its first part's end (n_base 7,
    # without the last token), not from the shared part's (a threshold of 4 took 3 rows each)
    seqs = [np.arange(9, dtype=np.int32), np.concatenate([np.arange(5), np.arange(20, 24)]).astype(np.int32)]
    p = mc._Prep(seqs, 5, 13, "Winogrande task 0 (line 1)", (7, 7))
    assert mc._winogrande_pairs(p) == [([2], [7]), ([6], [22])]
    # a choice word longer than the shared part (a blank that opens the sentence, after BOS): the
    # second choice's rows start after all of the first's and its own choice word (li = 7 + 3)
    seqs = [np.arange(9, dtype=np.int32), np.concatenate([np.arange(2), np.arange(20, 27)]).astype(np.int32)]
    p = mc._Prep(seqs, 2, 16, "Winogrande task 0 (line 1)", (5, 5))
    assert mc._winogrande_pairs(p) == [([3, 4, 5], [5, 6, 7]), ([10, 11, 12], [23, 24, 25])]


def test_winogrande_picks_the_second_choice_on_a_tie():
    # llama-perplexity: 'score_1st > score_2nd ? 1 : 2'. No two choices a tokenizer gives score the
    # same, so by hand: both choices' last three tokens read from the same logits
    seqs = [np.arange(10, dtype=np.int32), np.concatenate([np.arange(5), [20], np.arange(6, 10)]).astype(np.int32)]
    p = mc._Prep(seqs, 5, 16, "Winogrande task 0 (line 1)", (6, 6))
    rows = np.tile(np.random.default_rng(0).standard_normal(32, dtype=np.float32), (9, 1))
    (s1, s2), pred = mc._winogrande_scores(p, rows)
    assert s1 == s2 and np.isfinite(s1) and pred == 1


def test_two_endings_within_the_tie_margin_are_scored_in_llama_perplexitys_arithmetic():
    # the fast float64 means decide only with a clear winner; two endings that tie (by hand: every
    # logit 0) go through llama-perplexity's float arithmetic, exact, the first one picked (a check
    # of the margin skipped below three endings passed every test)
    seqs = [np.array([1, 2, 3, 4, 5], np.int32), np.array([1, 2, 3, 6, 7], np.int32)]
    p = mc._Prep(seqs, 3, 10, "task 0")
    rows = np.zeros((3, 32), np.float32)
    for in_float in (True, False):
        (s1, s2), pred, exact = mc._mean_scores(p, rows, 1, F.tie_margin(32), in_float)
        assert s1 == s2 == pytest.approx(-np.log(32)) and pred == 0 and exact


def test_a_winogrande_task_with_nothing_after_its_choices_scores_neither(model):
    # the blank ends the sentence and both choices add more than 3 tokens (partial scoring): no
    # token is scored after either choice, both means are 0/0 (-nan there) and the second is picked
    line = "0,The cat chased the _,big brown dog that barked,small grey mouse that squeaked,1\n\n"
    r = mc.winogrande(model, line, **T)
    (t,) = r.tasks
    assert math.isnan(t.scores[0]) and math.isnan(t.scores[1]) and t.pred == 1 and not t.correct
    assert r.report() == "1\t0.0000\t      -nan        -nan  2  1\n\n"


def test_batches_take_tasks_while_their_tokens_fit_n_ctx():
    """The packing loop of hellaswag_score and the others: the next task joins a batch while the
    tokens so far plus its own fit n_ctx (<=) and its sequences fit n_seq_max."""
    sizes = [5, 6, 7, 3, 12, 1]
    # tokens bind: 5 + 6 = 11, + 7 > 12; 7 + 3, + 12 > 12; 12 exactly; 1
    assert mc._groups(_preps(sizes), 12, 100, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    # sequences bind: two tasks of 4 endings in 8 sequences
    assert mc._groups(_preps([1] * 5), 100, 8, 4) == [(0, 2), (2, 4), (4, 5)]
    # the multiple-choice mode counts each task's own answers (per_task None)
    mixed = _preps([1, 1, 1]) + _preps([1], n_seqs=2)
    assert mc._groups(mixed, 100, 6, None) == [(0, 1), (1, 2), (2, 4)]
    with pytest.raises(ValueError, match="has 4 endings, more than the 3 sequences"):
        mc._groups(_preps([1]), 100, 3, 4)
    # 6 + 6 is past 11 (6 | 6, 6, is not)
    assert mc._groups(_preps([6, 6]), 11, 100, 4) == [(0, 1), (1, 2)]
    # past 256 tasks (counts compared with `is` hold only for Python's small ints)
    assert mc._groups(_preps([1] * 300), 100, 1000, 4) == [(0, 100), (100, 200), (200, 300)]


def test_hellaswag_batches_hold_at_most_32_tasks(model):
    """llama-perplexity's max_tasks_per_batch: at most 4 * 32 sequences of a batch, however many
    the context has. With n_batch the tokens of the first 32 tasks, a batch of 32 tasks is one
    decode: 40 tasks take 2 (32 + 8), where 33 or 34 tasks in the first would take 3; the first 32
    alone take 1 (a cap of 31 tasks took 2)."""
    n_tok = [t.n_tokens for t in mc.hellaswag(model, None, 40, **ON).tasks]
    n_batch = sum(n_tok[:32])
    assert sum(n_tok[:33]) <= 4096 and n_batch < sum(n_tok[:33])
    with model.context(n_ctx=4096, n_batch=n_batch, n_ubatch=512, n_seq_max=136, kv_unified=True, **T) as ctx:
        r = mc.hellaswag(ctx, None, 40)
        r32 = mc.hellaswag(ctx, None, 32)
    assert r.n_seq_max == 136 and r.n_decodes == 2 and [t.n_tokens for t in r.tasks] == n_tok
    assert r32.n_decodes == 1 and [t.n_tokens for t in r32.tasks] == n_tok[:32]


def test_near_ties_are_decided_in_llama_perplexitys_float_arithmetic(model, monkeypatch):
    # two identical endings tie exactly: the first wins, as with its strict `>`
    text = "Eating: A man takes a bite of an apple. He\n2\nchews it slowly.\nsmiles.\nchews it slowly.\nsmiles.\n"
    r = mc.hellaswag(model, text, 1, **T)
    t = r.tasks[0]
    assert t.exact and t.scores[0] == t.scores[2] and t.scores[1] == t.scores[3]
    assert t.pred == (0 if t.scores[0] > t.scores[1] else 1)
    fast = mc.hellaswag(model, None, 5, **T)
    assert not all(t.exact for t in fast.tasks)  # clear winners are taken from the fast C path
    monkeypatch.setattr(F, "tie_margin", lambda n_vocab: math.inf)  # every task in float arithmetic
    slow = mc.hellaswag(model, None, 5, **T)
    assert all(t.exact for t in slow.tasks) and slow.report() == fast.report()
    for a, b in zip(fast.tasks, slow.tasks):
        assert np.max(np.abs(np.array(a.scores) - b.scores)) < F.tie_margin(model.n_vocab) / 2


WG = (
    "0,The trophy did not fit in the suitcase because the _ was too big for it.,trophy,suitcase,1\n"
    "1,The cat chased the _.,dog,mouse,2\n"
    "2,Anna thanked Maria because _ had helped her move the heavy boxes upstairs.,Anna,Maria,2\n"
    "3,The cat chased the _ away.,dog,mouse,2\n"  # 3 tokens after the shared part: not skipped either
    # 3 after it in the first, 4 in the second: not skipped (the shared part is 5 tokens, the longer
    # sentence 9: the counts compared with ^ for -, 8 ^ 5 = 13, skipped it)
    "4,The old cat chased the _ away.,dog,big mouse,2\n"
    "5,The old cat chased the _ away.,big dog,mouse,1\n\n"  # and 4, 3
)


# and 2 after the shared part in the first, 4 in the second, then 4 and 2: not skipped (a count
# compared with != 3, not > 3, skipped them)
WG8 = WG.rstrip("\n") + (
    "\n6,The cat chased the _.,dog,big brown mouse,2\n7,The cat chased the _.,big brown mouse,dog,1\n\n"
)


def test_winogrande_partial_scores_as_winogrande_score(model):
    r = mc.winogrande(model, WG8, **ON)
    tasks, _ = mc.read_winogrande(WG8)
    assert len(r.tasks) == 8 and all(t.exact for t in r.tasks)
    # a task count past the file's (9 of 8), or equal to it, takes all of them in order, as
    # --winogrande-tasks does (n <= 8 drew the 8 at random)
    assert mc.winogrande(model, WG8, 9, **ON).report() == r.report()
    assert mc.winogrande(model, WG8, 8, **ON).report() == r.report()
    with model.context(n_ctx=256, **ON) as ctx:
        for t in r.tasks:
            w = tasks[t.task]
            seqs = [model.tokenize(w.first + c + w.second) for c in w.choices]
            n_base = [len(model.tokenize(w.first + c)) for c in w.choices]
            cp = next(k for k in range(min(map(len, seqs))) if seqs[0][k] != seqs[1][k])
            lps = [alone_logprobs(model, ctx, s) for s in seqs]
            skip = all(len(s) - cp > 3 for s in seqs)
            if t.task in (4, 5):  # the edge of llama-perplexity's k_min_trailing_ctx (3) in one choice only
                assert [len(s) - cp for s in seqs] == ([3, 4] if t.task == 4 else [4, 3]) and cp == 5
            if t.task in (6, 7):
                assert [len(s) - cp for s in seqs] == ([2, 4] if t.task == 6 else [4, 2])
            ref = []
            for k, (s, lp) in enumerate(zip(seqs, lps)):
                nb = n_base[k] if skip else cp
                last = 1 if len(s) - nb > 1 else 0
                vals = [lp[j, s[j + 1]] for j in range(nb - 1, len(s) - 1 - last)]
                if k == 1 and not skip:  # the FIXME: the second choice's first row is the first sentence's last
                    vals[0] = lps[0][len(seqs[0]) - 1, s[cp]]
                ref.append(np.mean(vals))
            assert skip == (t.task in (0, 2))
            # float sums of 49,152 terms there: within n_vocab * 2^-24 of the exact sums
            assert np.max(np.abs(np.array(t.scores) - ref)) < F.tie_margin(model.n_vocab) / 2, (t, ref)
            assert t.pred == (0 if t.scores[0] > t.scores[1] else 1) and t.gold == (w.answer - 1,)
    line = r.report().split("\n")[0]
    s1, s2 = r.tasks[0].scores
    assert line == f"1\t{100.0 * r.tasks[0].correct:.4f}\t{s1:10.6f}  {s2:10.6f}  {r.tasks[0].pred + 1}  1"
    assert "Final" not in r.report()  # under 100 tasks, as there


def test_winogrande_one_token_after_the_choice_word_is_scored_over_it(model):
    # issue 36, section 2: "without the last token when more than one remain": with exactly one
    # after the choice word (and more than 3 after the shared part: partial scoring), that one is scored
    first, second = "Anna could not lift the box that ", "."
    choices = ("the big heavy wooden crate", "the small light paper bag")
    r = mc.winogrande(model, f"0,{first}_{second},{choices[0]},{choices[1]},2\n\n", **ON)
    (t,) = r.tasks
    with model.context(n_ctx=64, **ON) as ctx:
        for k, c in enumerate(choices):
            seq = model.tokenize(first + c + second)
            n_base = len(model.tokenize(first + c))
            assert seq.size - n_base == 1  # the "." alone after the choice word
            lp = alone_logprobs(model, ctx, seq)
            assert abs(t.scores[k] - lp[n_base - 1, seq[n_base]]) < F.tie_margin(model.n_vocab) / 2, (t, k)


def test_multiple_choice_file_with_100_answers_round_trips():
    # issue 36, section 2: the binary format's limit (100 answers, llama-perplexity's) is allowed, not refused
    answers = tuple(f"answer {i}" for i in range(100))
    t = mc.MultipleChoiceTask("Which one?", answers, (0,) * 99 + (1,), answers[:3], (1, 0, 1))
    (back,) = mc.read_multiple_choice(mc.write_multiple_choice([t]))
    fields = ("question", "answers", "labels", "mc2_answers", "mc2_labels")
    assert [getattr(back, f) for f in fields] == [getattr(t, f) for f in fields]


def test_winogrande_selection_and_final_score(model):
    lines = [f"{i},{'AB'[i % 2]} met _ today.,{'xyzw'[i % 4]},{'pqrs'[i % 3]},{1 + i % 2}" for i in range(110)]
    text = "\n".join(lines) + "\n\n"
    r = mc.winogrande(model, text, 100, **T)  # the final score from 100 tasks on, as there
    assert [t.task for t in r.tasks] == R.pick_without_replacement(110, 100)
    p = np.float32(r.n_correct) / np.float32(100)
    sigma = np.float32(100 * math.sqrt(float(p * (1 - p) / np.float32(99))))
    want = f"Final Winogrande score(100 tasks): {float(np.float32(100) * p):.4f} +/- {float(sigma):.4f}\n"
    assert r.report().endswith("\n\n" + want)
    n = 0  # each task's line: its number, the running accuracy, both scores, the pick and the answer
    for i, (t, line) in enumerate(zip(r.tasks, r.report().split("\n"))):
        n += t.correct
        num, acc, rest = line.split("\t")
        assert (num, acc) == (str(i + 1), f"{100 * n / (i + 1):.4f}"), line
        assert rest.split() == [f"{t.scores[0]:.6f}", f"{t.scores[1]:.6f}", str(t.pred + 1), str(t.gold[0] + 1)]
        assert t.correct == (t.pred == t.gold[0])
    assert 0 < n < 100
    assert r.stderr == pytest.approx(float(sigma) / 100, rel=1e-5)
    assert "Final" not in mc.winogrande(model, text, 99, **T).report()
    assert "\nFinal Winogrande score(101 tasks): " in mc.winogrande(model, text, 101, **T).report()  # not 100 only


def test_winogrande_puts_up_to_128_tasks_in_a_batch(model):
    # llama-perplexity's max_tasks_per_batch (128, two sequences each): with 256 sequences, 128 short
    # tasks go in one decode (a cap of 130 sequences took two, of 254 two); their pieces are over
    # 256, and each task's rows are found in them (a loop over the pieces that compared with 'is
    # not' ran past them)
    lines = [f"{i},{'AB'[i % 2]} met _ today.,{'xyzw'[i % 4]},{'pqrs'[i % 3]},{1 + i % 2}" for i in range(128)]
    r = mc.winogrande(model, "\n".join(lines) + "\n\n", n_ctx=8, n_batch=2048, n_parallel=256, **T)
    assert len(r.tasks) == 128 and r.n_seq_max == 256 and r.n_decodes == 1, r


def test_multiple_choice_puts_up_to_128_sequences_in_a_batch_and_takes_all_tasks_past_the_count(model):
    # llama-perplexity's max_seq, 4 * 32 sequences: with 160, 33 tasks of 4 answers take two decodes
    # (32 tasks, then 1; a cap of 36 took four, of 160 one), and 64 tasks two (a cap of 124 or 96
    # sequences, 31 or 24 tasks, took three)
    labels = [tuple(int(k == i % 4) for k in range(4)) for i in range(64)]
    tasks = [mc.MultipleChoiceTask(f"Q{i}: which?", tuple("abcd"), labels[i]) for i in range(64)]
    raw = mc.write_multiple_choice(tasks[:33])
    r = mc.multiple_choice(model, raw, n_ctx=8, n_batch=768, n_parallel=160, **T)
    assert len(r.tasks) == 33 and r.n_seq_max == 160 and r.n_decodes == 2
    r = mc.multiple_choice(model, mc.write_multiple_choice(tasks), n_ctx=8, n_batch=768, n_parallel=160, **T)
    assert len(r.tasks) == 64 and r.n_decodes == 2
    # --multiple-choice-tasks past the file's count: all of them, in order (as 0 does)
    r = mc.multiple_choice(model, raw, 50, n_ctx=8, n_batch=768, n_parallel=160, **T)
    assert [t.task for t in r.tasks] == [*range(33)]
    r = mc.multiple_choice(model, raw, 33, n_ctx=8, n_batch=768, n_parallel=160, **T)  # and at it
    assert [t.task for t in r.tasks] == [*range(33)]


def test_multiple_choice_tasks_of_three_answers_share_a_batch_in_their_own_sequences(model):
    # with 8 sequences, two tasks of 3 answers go in one batch, the second in sequences 3 to 5 (its
    # seq ids as s0 ^ s, 3 ^ 1 = 2, went into the first task's; as s0 | s, all three into 3, which
    # answers of one token each hid: a last token has no row): the scores of each task alone
    tasks = [
        mc.MultipleChoiceTask("Which color is the sky on a clear day?", ("blue and clear", "green like grass",
                                                                         "red at dusk"), (1, 0, 0)),
        mc.MultipleChoiceTask("What do cows drink most of the time?", ("milk from cows", "plain cold water",
                                                                      "orange juice"), (0, 1, 0)),
    ]  # fmt: skip
    raw = mc.write_multiple_choice(tasks)
    both = mc.multiple_choice(model, raw, n_parallel=8, **T)
    alone = mc.multiple_choice(model, raw, n_parallel=4, **T)
    assert both.n_decodes == 1 and alone.n_decodes == 2
    for a, b in zip(both.tasks, alone.tasks):
        assert np.max(np.abs(np.array(a.scores) - b.scores)) < F.tie_margin(model.n_vocab) / 2 and a.pred == b.pred


def test_only_a_label_of_1_is_a_right_answer(model):
    # the labels are int32; llama-perplexity counts an answer right where its label == 1
    raw = mc.write_multiple_choice([mc.MultipleChoiceTask("Pick one:", ("yes", "no", "maybe"), (2, 1, -1))])
    t = mc.multiple_choice(model, raw, **T).tasks[0]
    assert t.gold == (1,) and t.correct == (t.pred == 1)
    # the label 2 on each answer in turn, so that the one the model picks has it in one task
    labels = [(2, 1, 0), (1, 2, 0), (1, 0, 2)]
    raw = mc.write_multiple_choice([mc.MultipleChoiceTask("Pick one:", ("yes", "no", "maybe"), ls) for ls in labels])
    r = mc.multiple_choice(model, raw, **T)
    assert [t.correct for t in r.tasks] == [labels[t.task][t.pred] == 1 for t in r.tasks]
    assert any(labels[t.task][t.pred] == 2 for t in r.tasks)


def test_multiple_choice_scores_and_final_lines(model):
    r = mc.multiple_choice(model, None, **ON)
    tasks = mc.read_multiple_choice(mc.sample_path("multiple-choice"))
    assert len(r.tasks) == 40 and r.n_decodes < 40  # tasks of 2 or 3 answers share a batch of 4 sequences
    # -c 512 a sequence, and -b 2048 (n_batch is min(-b, n_ctx); llama.cpp pads n_ctx to 256)
    assert r.n_seq_max == 4 and r.n_ctx == r.n_batch == 4 * 512
    with model.context(n_ctx=256, **ON) as ctx:
        for t in r.tasks[::8]:
            q = tasks[t.task]
            ref = mean_after(model, ctx, [q.question + " " + a for a in q.answers])
            assert np.max(np.abs(np.array(t.scores) - ref)) < 2e-4 and t.pred == int(np.argmax(ref))
            assert t.correct == (q.labels[t.pred] == 1)
            assert t.gold == tuple(k for k, v in enumerate(q.labels) if v == 1) and t.gold
    n = r.n_correct
    text = r.report()
    assert text.startswith("\ntask\tacc_norm\n1\t") and f"\n40\t{100 * n / 40:.8f}\n\n" in text
    p = np.float32(n) / np.float32(40)
    s = np.float32(np.sqrt(p * (np.float32(1) - p) / np.float32(39)))
    assert f"Final result: {float(np.float32(100) * p):.4f} +/- {float(np.float32(100) * s):.4f}\n" in text
    q = np.float32(40) / np.float32(sum(len(t.answers) for t in tasks))
    s = np.float32(np.sqrt(q * (np.float32(1) - q) / np.float32(39)))
    assert text.endswith(f"Random chance: {float(np.float32(100) * q):.4f} +/- {float(np.float32(100) * s):.4f}\n")
    some = mc.multiple_choice(model, None, 5, **T)
    assert [t.task for t in some.tasks] == R.pick_without_replacement(40, 5)
    assert some.seconds > 0 and some.tasks_per_second == pytest.approx(5 / some.seconds)
    # two tasks: the deviation over n - 1 = 1 (one task divides by 0 as there: the final result's
    # 0/0 is x86's -nan, the random chance's p (1 - p) / 0 is inf)
    two = mc.multiple_choice(model, None, 2, **T)
    p = np.float32(two.n_correct) / np.float32(2)
    s = np.float32(np.sqrt(p * (np.float32(1) - p) / np.float32(1)))
    assert f"Final result: {float(np.float32(100) * p):.4f} +/- {float(np.float32(100) * s):.4f}\n" in two.report()
    one = mc.multiple_choice(model, None, 1, **T).report()
    assert re.search(r"\nFinal result: \d+\.0000 \+/- -nan\nRandom chance: \d+\.\d{4} \+/- inf\n", one), one


# -- refusals, all before any decode -------------------------------------------------------------
def test_refusals_before_any_decode(model):
    with pytest.raises(ValueError, match="n_tasks must be at least 1, not 0"):
        mc.hellaswag(model, None, 0, **T)
    with pytest.raises(ValueError, match="n_tasks must be at least 1"):
        mc.winogrande(model, None, -3, **T)
    long = "Talking: " + "and then " * 150 + "she\n0\nstops.\nsings.\nwaits.\nleaves.\n"
    with pytest.raises(ValueError, match=r"HellaSwag task 0 \(line 1\) needs 312 tokens, 56 more than n_ctx 256"):
        mc.hellaswag(model, long, n_ctx=8, **T)  # 4 sequences of 8 cells, which llama.cpp pads to 256
    exact = "Talking: " + "and then " * 122 + "she\n0\nstops.\nsings.\nwaits.\nleaves.\n"
    assert mc.hellaswag(model, exact, n_ctx=8, **T).tasks[0].n_tokens == 256  # exactly n_ctx fits (>= refused it)
    longer = "Talking: " + "and then " * 300 + "she\n0\nstops.\nsings.\nwaits.\nleaves.\n"
    with pytest.raises(ValueError, match=r"needs 612 tokens, 356 more than n_ctx 256"):  # past twice n_ctx
        mc.hellaswag(model, longer, n_ctx=8, **T)
    with model.context(n_ctx=512, n_seq_max=4, **T) as ctx:  # not unified
        with pytest.raises(ValueError, match="without kv_unified"):
            mc.hellaswag(ctx, None, 1)
    with model.context(n_ctx=512, n_seq_max=2, kv_unified=True, **T) as ctx:
        with pytest.raises(ValueError, match="needs 4 sequences"):
            mc.hellaswag(ctx, None, 1)
        with pytest.raises(ValueError, match="context keywords are for a Model"):
            mc.winogrande(ctx, None, 1, n_threads=1)
    with model.context(n_ctx=512, n_seq_max=3, kv_unified=True, **T) as ctx:  # one short: this message, not _groups'
        with pytest.raises(ValueError, match="HellaSwag needs 4 sequences per task; this Context has n_seq_max 3"):
            mc.hellaswag(ctx, None, 1)
    with model.context(n_ctx=512, n_seq_max=4, kv_unified=True, **T) as ctx:  # 4 is enough
        assert mc.hellaswag(ctx, None, 1).n_seq_max == 4
    five = mc.write_multiple_choice([mc.MultipleChoiceTask("Pick one:", ("a", "b", "c", "d", "e"), (0, 1, 0, 0, 0))])
    with pytest.raises(ValueError, match=r"has 5 endings, more than the 4 sequences.*at least 5"):
        mc.multiple_choice(model, five, **T)
    assert mc.multiple_choice(model, five, n_parallel=5, **T).n_seq_max == 5
    same = "Q: A man. He\n0\nruns.\nruns. Fast\nruns.\nruns.\n"
    with pytest.raises(ValueError, match="ending 0 adds no token"):
        mc.hellaswag(model, same, **T)
    # the same past 256 shared tokens (a count compared with ``is`` holds below 257 only)
    long = same.replace("Q: A man. He", "Q: " + "A man. " * 100 + "He")
    with pytest.raises(ValueError, match=r"ending 0 adds no token to what all endings share \(30\d tokens\)"):
        mc.hellaswag(model, long, **T)
    # the default model adds no BOS: a blank that opens the sentence leaves the choices no shared
    # token, where llama-perplexity's flag of the shared part's last token would land before the batch
    with pytest.raises(ValueError, match=r"task 0 \(line 1\): its endings share no token"):
        mc.winogrande(model, "0,_ was late so she ran.,Anna,Bob,1\n\n", **T)
    with pytest.raises(ValueError, match="not a multiple of 6"):
        mc.hellaswag(model, mc.sample_path("winogrande"), **T)


def test_a_multiple_choice_file_given_as_a_str_with_a_newline_is_its_content(model):
    """As the readers take it: a str with a newline is the file's content (its bytes decoded with
    surrogateescape), not a path; without one it is a path."""
    raw = mc.write_multiple_choice([mc.MultipleChoiceTask("Pick one\nof these:", ("a", "b"), (0, 1))])
    text = raw.decode("utf-8", "surrogateescape")
    assert "\n" in text
    assert mc.multiple_choice(model, text, **T).report() == mc.multiple_choice(model, raw, **T).report()


def test_the_package_names(model):
    ev = pl.evaluation
    assert ev.hellaswag is mc.hellaswag and ev.winogrande is mc.winogrande
    assert ev.MultipleChoiceResult is mc.MultipleChoiceResult
    r = ev.multiple_choice(model, None, 2, **T)
    assert r.n_tasks == 2 and mc.multiple_choice(model, None, 2, **T).report() == r.report()


# -- the command line ----------------------------------------------------------------------------
def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pyllamacpp", "perplexity", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tempfile.gettempdir(),
        **kw,
    )


def test_cli_modes_print_the_api_report(model, tmp_path):
    r = cli("--hellaswag", "--hellaswag-tasks", "3", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == mc.hellaswag(model, None, 3, **T).report() + "\n"
    assert "hellaswag: hellaswag.txt, 3 task(s) asked, n_ctx 2048" in r.stderr
    w = tmp_path / "w.csv"
    w.write_text("no,comma\n" + WG)
    r = cli("--winogrande", "-f", str(w), "-t", "1", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["n_tasks"] == 6 and d["skipped"] == [[1, "failed to find comma separators in <no,comma>"]]
    assert "winogrande: line 1 skipped: failed to find comma separators" in r.stderr


def test_cli_says_what_was_used_and_sums_up_on_stderr(tmp_path):
    # issue 36: "400 task(s) asked" for a file of 2, and no summary at the end
    hs = tmp_path / "hs.txt"
    hs.write_text("".join(f"{t.context}\n{t.gold}\n" + "".join(e + "\n" for e in t.endings) for t in
                          mc.read_hellaswag(mc.sample_path("hellaswag"))[:2]))  # fmt: skip
    r = cli("--hellaswag", "-f", str(hs), "-t", "1")
    assert r.returncode == 0, r.stderr
    assert "hellaswag: hs.txt, 400 task(s) asked, 2 in the file: all 2 used, n_ctx 2048" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"hellaswag: 2 task\(s\) scored, acc_norm \d+\.\d\d% \(95% interval \[.*\]\); "
                        r"\d+ tokens in \d+ decodes, \d+\.\d s \(\d+\.\d\d tasks/s\)", last), last  # fmt: skip
    assert "task(s) scored" not in r.stdout  # llama-perplexity's lines stay its own
    w = tmp_path / "w.csv"
    w.write_text(WG.rstrip("\n"))  # its last line without a newline: not read, and said once
    r = cli("--winogrande", "-f", str(w), "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("pyllamacpp perplexity: warning: Winogrande data, line 6: not read") == 1, r.stderr
    assert re.search(r"winogrande: 5 task\(s\) scored, accuracy \d+\.\d\d% \+/- \d+\.\d\d; ", r.stderr)


def test_cli_ctrl_c_says_how_many_tasks_were_scored():
    from conftest import popen_command

    proc = popen_command(["perplexity", "--hellaswag", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("2\t"):  # two tasks scored, the third being decoded
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    done = sum(line[:1].isdigit() for line in "".join(out).splitlines() + rest.splitlines())
    assert f"hellaswag: interrupted (Ctrl-C) after {done} of 40 task(s): the lines above are the tasks scored" in err
    assert "400 task(s) asked, 40 in the file: all 40 used" in err


def test_cli_refusals(tmp_path):
    r = cli("--multiple-choice", "--multiple-choice-tasks", "0")
    assert r.returncode == 2 and "must be at least 1, not 0 (llama-perplexity reads 0 as all tasks" in r.stderr
    r = cli("--hellaswag", "--winogrande")
    assert r.returncode == 2 and "pick one" in r.stderr
    r = cli("--hellaswag", "--chunks", "3")
    assert r.returncode == 2 and "takes no --kl-divergence" in r.stderr
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<II", 1, 8) + b"\x05\0\0\0ab")
    r = cli("--multiple-choice", "-f", str(bad))
    assert r.returncode == 2 and "task 0 of 1: the question at byte 12: needs 5 bytes, 2 left" in r.stderr
    r = cli("--hellaswag", "-f", str(mc.sample_path("winogrande")))
    assert r.returncode == 2 and "not a multiple of 6" in r.stderr
    h = cli("--help")
    assert "--hellaswag-tasks N" in h.stdout and "--multiple-choice" in h.stdout and "-np" in h.stdout


def _pty_run(args: list[str], stdout_pty: bool, stderr_pty: bool) -> tuple[str, str]:
    """The command under a pseudo-terminal: what the terminal showed, and what a pipe got."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyllamacpp", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave if stdout_pty else subprocess.PIPE,
        stderr=slave if stderr_pty else subprocess.PIPE,
        cwd=tempfile.gettempdir(),
    )
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the last writer closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    piped = (proc.stdout or proc.stderr).read() if (proc.stdout or proc.stderr) else b""
    proc.wait(timeout=600)
    os.close(master)
    assert proc.returncode == 0, shown.decode(errors="replace") + piped.decode(errors="replace")
    return shown.decode().replace("\r\n", "\n"), piped.decode()


def test_progress_and_results_do_not_interleave_on_a_terminal(tmp_path):
    # issue #29: on a terminal, `[6]19.5180,perplexity: chunk 7/8`
    text = tmp_path / "t.txt"
    text.write_text(scoring.sample_text()[:3000])
    args = ["perplexity", "-f", str(text), "-c", "64", "-b", "128", "--chunks", "3", "-t", "1"]
    shown, _ = _pty_run(args, True, True)
    assert re.search(r"(\[\d\]\d+\.\d{4},){3}\nFinal estimate: PPL = ", shown), shown
    assert "perplexity: chunk" not in shown  # the running estimates are the progress
    shown, piped = _pty_run(args, False, True)  # results to a pipe, progress on the terminal
    assert re.fullmatch(r"(\[\d\]\d+\.\d{4},){3}\nFinal estimate: PPL = \S+ \+/- \S+\n", piped)
    assert "\r\x1b[Kperplexity: chunk 3/3\n" in shown and "perplexity: chunk 1/3\n" not in shown


def test_the_package_names_are_the_functions_whatever_was_imported_first():
    """``pl.evaluation.multiple_choice`` is the function even after the module that defines it was
    imported (it is ``llama_perplexity``, so no module shadows the function's name)."""
    import types

    import pyllamacpp as pl
    import pyllamacpp.evaluation.llama_perplexity as lp

    for name in ("hellaswag", "winogrande", "multiple_choice"):
        f = getattr(pl.evaluation, name)
        assert not isinstance(f, types.ModuleType) and f is getattr(lp, name)


def test_the_shipped_multiple_choice_file_is_built_from_text_into_the_cache(tmp_path, monkeypatch):
    """The package ships the questions as JSON lines; the binary file is written once into
    ``$PYLLAMACPP_CACHE/data`` and read from there."""
    monkeypatch.setenv("PYLLAMACPP_CACHE", str(tmp_path))
    assert not list(DATA.glob("*.bin"))
    p = mc.sample_path("multiple-choice")
    assert p.parent == tmp_path / "data" and p.suffix == ".bin"
    first = p.stat().st_mtime_ns
    assert mc.sample_path("multiple-choice") == p and p.stat().st_mtime_ns == first  # written once
    assert len(mc.read_multiple_choice(p)) == 40
    assert not list((tmp_path / "data").glob(".*.tmp"))


def _one_task(question: str, answers: list[str]) -> bytes:
    """A multiple-choice file of one task, written by hand (the writer refuses these)."""

    def string(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    labels = [1 if i == 0 else 0 for i in range(len(answers))]
    mc1 = struct.pack("<I", len(answers)) + b"".join(map(string, answers)) + struct.pack(f"<{len(labels)}i", *labels)
    return struct.pack("<II", 1, 8) + string(question) + mc1 + struct.pack("<I", 0)


@pytest.mark.parametrize(
    ("question", "answers", "said"),
    [("", ["a", "b"], "an empty question and/or no answers \\(llama-perplexity: 'found bad task'\\)"),
     ("Q?", [], "an empty question and/or no answers"),
     ("Q?", ["a", ""], "an empty answer \\(llama-perplexity: 'found empty answer'\\)")],
)  # fmt: skip
def test_multiple_choice_refuses_what_llama_perplexity_calls_a_bad_task(model, question, answers, said):
    raw = _one_task(question, answers)
    assert mc.read_multiple_choice(raw)[0].answers == tuple(answers)  # the reader takes it; the mode refuses
    with pytest.raises(ValueError, match=rf"^multiple-choice task 0 \(at byte 8\): {said}"):
        mc.multiple_choice(model, raw, **T)


def test_the_modes_count_their_decodes_and_tokens(model, monkeypatch):
    # n_decodes and n_tokens are the llama_decode calls made and the tokens in their batches
    from pyllamacpp.context import Context

    seen: list[int] = []
    real = Context.decode
    monkeypatch.setattr(
        Context, "decode", lambda self, batch, *a, **kw: (seen.append(len(batch)), real(self, batch, *a, **kw))[1]
    )
    for run in (lambda: mc.winogrande(model, WG, **T), lambda: mc.hellaswag(model, None, 3, **T),
                lambda: mc.multiple_choice(model, None, 3, **T)):  # fmt: skip
        seen.clear()
        r = run()
        assert (r.n_decodes, r.n_tokens) == (len(seen), sum(seen)) and r.n_decodes > 0


def test_the_modes_settings_are_keyword_only(model):
    for mode in (mc.hellaswag, mc.winogrande, mc.multiple_choice):
        with pytest.raises(TypeError, match="positional"):
            mode(model, None, 1, 512)
        # the data and the task count by keyword too (a '/' for the '*' made them positional-only)
        assert len(mode(model_or_ctx=model, data=None, n_tasks=1, **T).tasks) == 1


def test_the_modes_default_n_ctx_is_512_per_sequence(model):
    # 512 cells per sequence (-c), 4 sequences (513 passed every test), and n_batch min(-b, n_ctx):
    # llama.cpp pads n_ctx to a multiple of 256, so 511 (2,044) shows only in n_batch
    rs = [mode(model, None, 1, **T) for mode in (mc.hellaswag, mc.winogrande, mc.multiple_choice)]
    assert [(r.n_ctx, r.n_batch) for r in rs] == [(2048, 2048)] * 3
    # -b 2048 by default, seen where n_ctx is more (8 sequences; 2049 passed while n_ctx capped it)
    assert [
        mode(model, None, 1, n_parallel=8, **T).n_batch for mode in (mc.hellaswag, mc.winogrande, mc.multiple_choice)
    ] == [2048] * 3


def test_the_modes_close_the_context_they_make_from_a_model(model, monkeypatch):
    """Given a Model, a mode makes its own context (n_parallel sequences of n_ctx cells) and closes
    it when the run ends: left open, it held its KV cache until the garbage collector took it."""
    made = []
    real = type(model).context
    monkeypatch.setattr(type(model), "context", lambda self, **kw: made.append(real(self, **kw)) or made[-1])
    for mode in (mc.hellaswag, mc.winogrande, mc.multiple_choice):
        assert len(mode(model, None, 1, **T).tasks) == 1
        assert len(made) == 1 and made.pop().closed, mode.__name__


def test_the_modes_leave_a_callers_context_open_and_its_memory_cleared(model):
    """A Context passed in stays the caller's: open after each mode, its memory cleared as before
    the run (the last batch's cells left in it made the caller's next prefill of sequence 0 start
    past position 0), whether the run ended or was stopped (a mode closes only the context it made
    from a Model)."""
    with model.context(n_ctx=1024, n_seq_max=4, kv_unified=True, **T) as ctx:
        for mode in (mc.hellaswag, mc.winogrande, mc.multiple_choice):
            assert len(mode(ctx, None, 1).tasks) == 1
            assert not ctx.closed, mode.__name__
            assert [ctx.memory.seq_pos_max(s) for s in range(4)] == [-1] * 4, mode.__name__
            ctx.prefill(model.tokenize("The sky is"))
            assert ctx.memory.seq_pos_max(0) == 2
        real = ctx.decode

        def stop(*a, **kw):
            real(*a, **kw)
            raise KeyboardInterrupt

        ctx.decode = stop  # a Ctrl-C after the first batch was decoded
        for mode in (mc.hellaswag, mc.winogrande, mc.multiple_choice):
            with pytest.raises(KeyboardInterrupt):
                mode(ctx, None, 1)
            assert [ctx.memory.seq_pos_max(s) for s in range(4)] == [-1] * 4, mode.__name__
        del ctx.decode


def test_the_modes_read_a_special_token_s_text_as_text(model):
    """llama-perplexity tokenizes the tasks without parse_special (common_tokenize's default): an
    ending with "<|im_end|>" in it has 7 tokens of text there, not the special token."""
    from pyllamacpp.packing import common_prefix

    endings = ("runs.<|im_end|>", "walks.", "sits.", "stands.")
    r = mc.hellaswag(model, "Q: A man. He\n0\n" + "\n".join(endings) + "\n", **T)
    seqs = [model.tokenize("Q: A man. He " + e, True, False) for e in endings]
    cp = common_prefix(*seqs)
    assert r.tasks[0].n_tokens == cp + sum(s.size - cp for s in seqs)
    # what it is not: "runs", "." and the special token
    assert model.tokenize("Q: A man. He " + endings[0], True, True)[cp:].size == 3 < seqs[0].size - cp


def test_a_vocabulary_that_adds_bos_has_it_before_each_task_as_llama_perplexity_tokenizes(model, monkeypatch):
    """llama-perplexity tokenizes each task's texts with add_special (common_tokenize(..., true)):
    a vocabulary that adds BOS puts it at the head of the shared part, one token more per task in
    every mode. The default model adds no BOS, so the tokenizer is made to add one here."""
    tokenize = type(model).tokenize
    mcq = mc.write_multiple_choice([mc.MultipleChoiceTask("The sky is", ("blue", "green"), (1, 0))])
    runs = {
        "hellaswag": lambda: mc.hellaswag(model, None, 2, **T),
        "winogrande": lambda: mc.winogrande(model, None, 2, **T),
        "multiple_choice": lambda: mc.multiple_choice(model, mcq, **T),
    }
    plain = {k: [t.n_tokens for t in run().tasks] for k, run in runs.items()}

    def adds_bos(self, text, add_special=True, parse_special=False):
        t = tokenize(self, text, False, parse_special)
        return np.concatenate([[self.bos], t]).astype(np.int32) if add_special else t

    monkeypatch.setattr(type(model), "tokenize", adds_bos)
    for k, run in runs.items():
        assert [t.n_tokens for t in run().tasks] == [n + 1 for n in plain[k]], k


def test_the_modes_refuse_settings_they_cannot_run(model):
    for kw in ({"n_ctx": 0}, {"n_ctx": -1}, {"n_batch": 0}, {"n_batch": -1}, {"n_parallel": 0}, {"n_parallel": -1}):
        with pytest.raises(ValueError, match=r"n_ctx \(.*\), n_batch \(.*\) and n_parallel \(.*\) must be positive"):
            mc.winogrande(model, WG, **kw, **T)
    # the smallest -c runs, on the context llama.cpp makes of it: 4 sequences of 1 cell, padded to 256
    assert mc.winogrande(model, WG, n_ctx=1, **T).n_ctx == 256
    with model.context(n_ctx=256, n_seq_max=1, **T) as ctx:
        with pytest.raises(ValueError, match="Winogrande needs 2 sequences per task; this Context has n_seq_max 1"):
            mc.winogrande(ctx, WG)
    with model.context(n_ctx=512, n_seq_max=2, kv_unified=True, **T) as ctx:  # 2 is enough (3 passed)
        assert mc.winogrande(ctx, WG).n_seq_max == 2
    with pytest.raises(ValueError, match="uniform_int: b 2 < a 3"):
        R.uniform_int(R.MT19937(1), 3, 2)


def test_logf_falls_back_past_libraries_that_do_not_load(monkeypatch):
    import ctypes
    import ctypes.util

    real, tried = ctypes.CDLL, []

    def first_fails(name, *a, **kw):
        tried.append(name)
        if len(tried) == 1:
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *a, **kw)

    monkeypatch.setattr(ctypes, "CDLL", first_fails)
    f = F._load_logf()
    assert len(tried) == 2 and f is not None and f(2.0) == pytest.approx(math.log(2.0), rel=1e-6)

    def none_loads(name, *a, **kw):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", none_loads)
    assert F._load_logf() is None

    # no libm found by name (find_library gives None): that name is skipped, the next ones tried
    tried.clear()

    def only_ucrtbase(name, *a, **kw):
        tried.append(name)
        if name != "ucrtbase":
            raise OSError(f"{name}: cannot open shared object file")
        return real("libm.so.6")

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(ctypes, "CDLL", only_ucrtbase)
    f = F._load_logf()
    assert tried == ["libm.so.6", "ucrtbase"] and f is not None and f(2.0) == pytest.approx(math.log(2.0), rel=1e-6)
    monkeypatch.setattr(F, "_logf_c", None)  # no C library: the double log, rounded to float
    assert F.logf(np.float32(2.0)) == np.float32(math.log(2.0)) and F.logf(np.float32(0.0)) == -np.inf


def test_the_tie_margin_covers_twice_a_float_sums_rounding_over_the_vocabulary():
    # each token's log-probability is within about n_vocab * 2^-24 of the exact one, plus a few
    # float roundings (four, of a log-probability up to 64 nats: 2^-18 each), a mean of them too;
    # two means move by twice that: the margin is no less, and not far more
    for n_vocab in (1000, 32000, 151936):
        bound = 2 * (n_vocab * 2.0**-24 + 4 * 2.0**-18)
        assert bound < F.tie_margin(n_vocab) < 1.2 * bound + 1e-3


def test_multiple_choice_near_ties_are_summed_in_float(model, monkeypatch):
    # the multiple-choice mode sums a near tie's log-probabilities in float (HellaSwag: in double)
    fast = mc.multiple_choice(model, None, 5, **T)
    margin = F.tie_margin(model.n_vocab)
    assert not all(t.exact for t in fast.tasks)
    monkeypatch.setattr(F, "tie_margin", lambda n_vocab: math.inf)  # every task in float arithmetic
    slow = mc.multiple_choice(model, None, 5, **T)
    assert all(t.exact for t in slow.tasks) and slow.report() == fast.report()
    for a, b in zip(fast.tasks, slow.tasks):
        assert all(float(np.float32(v)) == v for v in b.scores)  # float32 means
        assert np.max(np.abs(np.array(a.scores) - b.scores)) < margin / 2
    hs = mc.hellaswag(model, None, 2, **T)
    assert not all(float(np.float32(v)) == v for t in hs.tasks for v in t.scores)  # sums in double there
    said = rf"<MultipleChoiceResult hellaswag: {hs.n_correct}/2 = {100 * hs.n_correct / 2:.2f}%, "
    assert re.fullmatch(said + rf"{hs.n_decodes} decodes of {hs.n_tokens} tokens in \d+\.\d s>", repr(hs)), repr(hs)


def test_the_readers_refuse_what_they_cannot_read():
    with pytest.raises(
        ValueError, match=r"mode must be one of \['hellaswag', 'multiple-choice', 'winogrande'\], not 'mmlu'"
    ):
        mc.sample_path("mmlu")
    with pytest.raises(TypeError, match="expected a path, a str or bytes, not int"):
        mc.read_multiple_choice(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^no tasks$"):
        mc.write_multiple_choice([])


def test_float_index_keeps_an_output_near_2_to_the_32_inside_the_tasks():
    # rng() within 128 of 2**32 rounds to 2**32 in float: llama-perplexity's index would be n
    for out, n, want in ((0xFFFFFFFF, 10, 9), (0xFFFFFF80, 7, 6), (0xFFFFFF7F, 7, 6), (0, 7, 0), (2**31, 10, 5)):
        assert R.float_index(lambda out=out: out, n) == want

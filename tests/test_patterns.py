"""Pattern files: parsing, file:line errors, source scopes, and the time bound."""

import contextlib
import hashlib
import threading
import time

import pytest

from sidecar.core import gate, patterns
from sidecar.core.patterns import PatternError, PatternSet, parse


def write_dir(tmp_path, lists="@verbs create read\n", negative="", high=""):
    (tmp_path / "lists.txt").write_text(lists)
    (tmp_path / "negative.txt").write_text(negative)
    (tmp_path / "high.txt").write_text(high)
    return tmp_path


def test_shipped_patterns_load_and_have_unique_ids():
    P = patterns.load_dir()
    assert len(P.negative) >= 10 and len(P.high) >= 5
    ids = [p.id for p in P.negative.patterns + P.high.patterns]
    assert len(ids) == len(set(ids))


def test_invalid_regex_names_file_and_line(tmp_path):
    d = write_dir(tmp_path, negative="# comment\n\nok \\bfine\\b\nbroken \\b(unclosed\n")
    with pytest.raises(PatternError) as e:
        patterns.load_dir(d)
    assert str(e.value).startswith(f"{d / 'negative.txt'}:4:")


def test_unknown_list_and_duplicate_id_are_errors(tmp_path):
    with pytest.raises(PatternError, match=r"high.txt:1: unknown list nouns"):
        patterns.load_dir(write_dir(tmp_path, high="x \\L<nouns>\n"))
    with pytest.raises(PatternError, match=r":2: duplicate id 'x' \(first at line 1\)"):
        parse("x a\nx b\n", "f.txt")


def test_missing_file_is_reported(tmp_path):
    (tmp_path / "lists.txt").write_text("")
    with pytest.raises(PatternError, match="negative.txt:0: cannot read"):
        patterns.load_dir(tmp_path)


def test_lists_are_shared_across_files_and_multiword_entries_match(tmp_path):
    d = write_dir(tmp_path, lists="@verbs create look_up\n", high="verb \\bplease\\s+\\L<verbs>\\b\n")
    P = patterns.load_dir(d)
    assert P.high.first("please look up the time", "user").text == "please look up"
    assert P.high.first("please Create it", "user") is not None
    assert P.high.first("please delete it", "user") is None


def test_source_scope(tmp_path):
    P = patterns.load_dir(write_dir(tmp_path, high="only_llm (llm) \\bnow\\b\n"))
    assert P.high.first("now", "llm") is not None
    assert P.high.first("now", "user") is None


def test_catastrophic_pattern_is_cut_off_by_the_time_budget():
    pats, _ = parse("evil (a|aa)+$\nafter \\bz\\b\n", "f.txt")
    ps = PatternSet(pats, timeout_s=0.01)
    text = "a" * 40 + "b z"
    t0 = time.perf_counter()
    m = ps.first(text, "user")
    elapsed = time.perf_counter() - t0
    assert m is not None and m.id == "after"  # the evil pattern was skipped, the next one still ran
    assert ps.timeouts == 1
    assert elapsed < 1.0  # unbounded, (a|aa)+$ on 40 a's takes hours


@pytest.mark.parametrize(
    "text,source,path",
    [
        ("I should call create_note", "llm", "high:"),
        ("let me search my notes for the kubernetes setup", "llm", "high:"),
        ("please create a note about this", "user", "high:"),
        ("the search algorithm", "user", "negative:"),
        ("delete operations are slow", "user", "negative:"),
        ("To create a note, you would use the API", "llm", "negative:"),
        ("my notes on kubernetes", "user", "negative:"),
        ("We use soft delete for users", "user", "negative:"),
        ("CRUD is enough here", "user", "negative:"),
        ("create table users (id int)", "user", "negative:"),
        ("Run `pip install foo` first", "llm", "negative:"),
        ("thanks", "user", "fallback"),
        ("let me see", "llm", "fallback"),
    ],
)
def test_screen_on_the_study_examples(text, source, path):
    assert gate.route(text, source, patterns.load_dir()).path.startswith(path)


@pytest.mark.parametrize(
    "text,fires",
    [
        ("Checking the git log to see when this changed", True),
        ("Now opening the dashboard in the browser", True),
        ("Pulling up the on-call schedule", True),
        ("Searching for where the config is loaded", True),
        ("Looking back, the design held up well", False),
        ("Running out of ideas here, honestly", False),
        ("Reading between the lines, they want a refund", False),
        ("The checking account was closed", False),
    ],
)
def test_llm_narration_in_the_present(text, fires):
    high = patterns.load_dir().high
    m = high.first(text, "llm")
    assert (m is not None and m.id == "narrating") == fires, m


@pytest.mark.parametrize(
    "text,path",
    [
        ("I'll jot this down as a new note so we keep it.", "high:first_person"),
        ("Let me look it up in the docs.", "high:let_me"),
        ("I'm going to pull the deploy logs up.", "high:first_person"),
        ("I'll bring it up at the next meeting.", "fallback"),  # not a verb that takes its particle late
        ("Let me look this over once more.", "fallback"),  # not one of its particles
        ("I'll jot all of the numbers from the meeting down", "fallback"),  # the object is at most three words
    ],
)
def test_a_separable_verb_takes_its_particle_after_a_short_object(text, path):
    assert gate.route(text, "llm", patterns.load_dir()).path == path


@pytest.mark.parametrize(
    "text,path",
    [
        ("Okay, I'm going to look at the recent commit history.", "high:first_person"),
        ("Let me look through my notes for what we decided about the rollout.", "high:let_me"),
        ("I'll look into why the build is failing.", "high:first_person"),
        ("Look at how nicely this reads.", "fallback"),  # an imperative to the reader, no first person
    ],
)
def test_looking_at_something_announces_an_action(text, path):
    assert gate.route(text, "llm", patterns.load_dir()).path == path


@pytest.mark.parametrize(
    "text,path",
    [
        ("I will look up your reservation details.", "high:first_person"),
        ("I can look up your reservation details and assist you further.", "negative:uncommitted"),  # an offer
        ("Once you confirm, I can calculate the total for you.", "negative:uncommitted"),
        # a commitment that waits on the customer's answer
        ("Please confirm if you would like to proceed with this change, and I'll update your reservation.", "negative:waits_on_user"),
        ("Please let me know which airport you are flying from, and I will search for flights.", "negative:waits_on_user"),
        ("Once confirmed, I'll make the necessary changes.", "negative:waits_on_user"),
        ("After you provide the order number, I will look up its status.", "negative:waits_on_user"),
        ("Thanks for confirming, I'll update your reservation now.", "high:first_person"),
        ("Please hold on while I will look up your reservation.", "high:first_person"),
    ],
)
def test_a_reply_that_offers_commits_to_nothing(text, path):
    assert gate.route(text, "llm", patterns.load_dir(), replies_commit=True).path == path


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("what's the status of PROJ-1423?", "names_artifact"),
        ("which files does PR #482 touch?", "names_artifact"),
        ("what's in src/config/settings.py?", "names_artifact"),
        ("what did commit a1b2c3d change?", "names_artifact"),
        ("something is still hogging port 3000", "names_artifact"),
        ("what time is it in Tokyo right now?", "asks_live"),
        ("who won the final last night?", "asks_live"),
        ("explain the CAP theorem", None),
        ("I had a long day today, thanks", None),  # "today" outside a question
        ("is HTTP/2 faster than HTTP/1.1 in general", None),
    ],
)
def test_user_turns_about_outside_state(text, pattern):
    m = patterns.load_dir().high.first(text, "user")
    assert (m.id if m else None) == pattern


# Regex safety (issue 13 F) ---------------------------------------------------------------


@pytest.mark.parametrize("regex_src", [r"(a+)+b", r"x(\w*)*", r"(?:\w+\s)+$", r"((ab)+c)*", r"(a*){2,}"])
def test_nested_quantifiers_are_refused_at_load_with_file_and_line(tmp_path, regex_src):
    d = write_dir(tmp_path, negative=f"# comment\nok \\bfine\\b\nevil {regex_src}\n")
    with pytest.raises(PatternError, match="nested quantifier") as e:
        patterns.load_dir(d)
    assert str(e.value).startswith(f"{d / 'negative.txt'}:3:")


@pytest.mark.parametrize("regex_src", [r"([\w.-]+\s+){0,3}x", r"(a|aa)+", r"(a++)+", r"(?>a+)+", r"(a+)?", r"[(a+)]+", r"\(a+\)+"])
def test_bounded_possessive_or_atomic_repetition_is_not_a_nested_quantifier(regex_src):
    assert patterns.nested_quantifier(regex_src) is None


def test_a_timeout_on_a_negative_pattern_blocks_and_is_counted_and_logged_once(caplog):
    evil, _ = parse("evil (a|aa)+$\nfine \\bslow\\b\n", "neg.txt")
    high, _ = parse("evil_high (a|aa)+$\nplease \\bplease\\b\n", "high.txt")
    neg = PatternSet(evil, timeout_s=0.005, name="negative", fail_closed=True)
    hi = PatternSet(high, timeout_s=0.005, name="high")
    both = patterns.GatePatterns(neg, hi)
    text = "please do it " + "a" * 40 + "b"
    with caplog.at_level("WARNING", logger="sidecar.patterns"):
        for _ in range(3):
            s = gate.route(text, "user", both)
            assert s.path == "negative:evil" and s.blocked and s.match.timed_out  # failed closed
        assert hi.first(text, "user").id == "please"  # a high one that timed out is no match
    assert (neg.timeouts, neg.timeouts_by_id["evil"]) == (3, 3) and hi.timeouts == 1
    said = [r.getMessage() for r in caplog.records if "evil" in r.getMessage()]
    assert len(said) == 2 and "neg.txt:1" in said[0] and "blocks" in said[0]  # once per pattern id



def test_a_search_given_little_time_is_unsettled_not_counted_and_the_full_budget_still_decides():
    """What the event loop asks (`within`): a slow text is left to the model thread, whose
    searches have the whole budget, so a text is never blocked for the loop's haste."""
    evil, _ = parse("evil (a|aa)+$\n", "neg.txt")
    high, _ = parse("please \\bplease\\b\n", "high.txt")
    neg = PatternSet(evil, timeout_s=0.005, name="negative", fail_closed=True)
    both = patterns.GatePatterns(neg, PatternSet(high, name="high"))
    slow = "please do it " + "a" * 40 + "b"
    t0 = time.process_time()
    with pytest.raises(patterns.Unsettled):
        gate.route(slow, "user", both, within=0.001)
    assert time.process_time() - t0 < 0.1 and neg.timeouts == 0  # cut off near its 1 ms, and not counted
    assert gate.route(slow, "user", both).path == "negative:evil" and neg.timeouts == 1  # the full budget: fails closed
    quick = gate.route("please do it", "llm", both, replies_commit=True, within=0.001)
    assert quick.path.startswith("high:please")
    assert gate.route("It is sunny.", "llm", both, replies_commit=True, within=0.001) is gate.UNCOMMITTED


@contextlib.contextmanager
def busy_threads(n: int = 3):
    """`n` threads of this process hashing (hashlib lets go of the GIL): real CPU work that
    counts against a regex budget, which `regex` measures in the process's CPU time."""
    stop = threading.Event()
    data = b"x" * (1 << 20)

    def burn() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    threads = [threading.Thread(target=burn, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    spent = time.process_time()
    while n and time.process_time() - spent < 0.01 * n:  # they are under way
        time.sleep(0.001)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_search_whose_budget_other_threads_spent_is_run_again_not_blocked():
    """A linear negative pattern that finds nothing in a long text, given a budget of just the
    CPU time it needs alone, beside three busy threads: they spend the budget (the search has
    about a quarter of the process's CPU), so the first run is cut off with under half of it
    on its own thread; the retry, at ten times the budget, finishes. Before: the harmless text
    was blocked."""
    pats, _ = parse("slow \\b\\w+(?:\\s+\\w+){0,8}\\s+\\d\n", "neg.txt")
    text = "the quick brown fox jumps over the lazy dog. " * 4000  # over 50 x 2,048 characters
    cpu = time.thread_time()
    assert pats[0].regex.search(text) is None
    need = time.thread_time() - cpu  # ~0.1 s here
    neg = PatternSet(pats, timeout_s=need / patterns.MAX_BUDGET_FACTOR, name="negative", fail_closed=True)
    assert neg.budget_s(len(text)) == pytest.approx(need)
    with busy_threads():
        m = neg.first(text, "user")
    assert (neg.retries, neg.timeouts, m) == (1, 0, None)


@pytest.mark.parametrize("busy", [0, 3])
def test_a_pattern_that_spends_its_budget_itself_still_fails_closed(busy):
    """(a|aa)+$ passes the lint but backtracks for hours on 40 a's and a b: its time is its own
    work, so it is cut off and blocks; alone it is not retried (it spent the budget itself),
    and with busy threads beside it, retried at most once, it still blocks."""
    evil, _ = parse("evil (a|aa)+$\n", "neg.txt")
    neg = PatternSet(evil, timeout_s=0.02, name="negative", fail_closed=True)
    with busy_threads(busy):
        m = neg.first("please create it " + "a" * 40 + "b", "user")
    assert m is not None and m.id == "evil" and m.timed_out and neg.timeouts == 1
    assert neg.retries == 0 if busy == 0 else neg.retries <= 1

ADVERSARIAL = {
    "a-": "a-" * 50_000,  # names_artifact was quadratic on this: 7.7 s
    "AB-1x": "AB-1x" * 20_000,
    "select": "select " * 15_000,  # sql_dml was quadratic on this
    "how does": "how does " * 11_000,
    "use": "use " * 25_000,
    "file a-": "file a-" * 14_000,
    "words": "the quick brown fox jumps over the lazy dog. " * 2_200,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_shipped_patterns_screen_100k_adversarial_characters_within_the_default_budget(name):
    """Every shipped pattern is linear: on 100k characters built to make super-linear ones
    backtrack, none reaches the default budget (a timeout would count, and block)."""
    P = patterns.load_dir()  # default 20 ms per 2,048 characters
    text = ADVERSARIAL[name]
    for source in ("user", "llm"):
        for ps in (P.negative, P.high):
            for p in ps.patterns:
                alone = PatternSet([p], ps.timeout_s, name=ps.name, max_chars=ps.max_chars)
                alone.first(text, source)
                assert (alone.timeouts, alone.retries) == (0, 0), (p.id, source)
    t0 = time.process_time()  # the clock `regex` counts budgets on (other processes do not count)
    gate.route(text, "user", P)
    elapsed = time.process_time() - t0
    assert (P.negative.timeouts, P.high.timeouts) == (0, 0)
    assert elapsed < P.negative.budget_s(len(text))  # the whole screen, all patterns, under one search's budget


def test_names_artifact_still_finds_what_it_did():
    [pat] = [p for p in patterns.load_dir().high.patterns if p.id == "names_artifact"]
    high = PatternSet([pat])
    for text, found in [("open src/config/settings.py now", "settings.py"), ("see my.config.json", "config.json"),
                        ("look at a-b_c.tsx", "a-b_c.tsx"), ("what's the status of PROJ-1423?", "PROJ-1423"),
                        ("which files does PR #482 touch?", "#482"), ("what did commit a1b2c3d change?", "commit a1b2c3d"), ("is a1b2c3d the fix?", "a1b2c3d"),
                        ("port 3000 is busy", "port 3000")]:  # fmt: skip
        m = high.first(text, "user")
        assert m is not None and m.id == "names_artifact" and m.text == found, (text, m)

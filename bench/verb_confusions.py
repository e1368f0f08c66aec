"""Read the verb probe's misses (fixtures/labeled/verbs.jsonl, issue 30 item 4): for every
request whose first tool is not an expected one, is that tool a different ACTION on the SAME
noun (the confusion the probe is for), the same action on another object, or neither?

    sidecar eval --catalog ... --labeled fixtures/labeled/verbs.jsonl --items /tmp/verbs-items.jsonl
    python bench/verb_confusions.py /tmp/verbs-items.jsonl [--list]

Each tool's action is written out below from what it does (git_show and get_issue read,
modify_email and edit_file update, get_tasks lists). A miss is "other verb, same noun" when
the first tool's action is none of the expected tools' and the tool is either another line's
expected tool in the same group (the strict count, "sibling"), on the same server as an
expected tool, or named by a word of the text other than a verb ("open notes.txt" ->
notes__semantic_search, "save ... posts/draft.md" -> gmail__draft_email).
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ACTION = {
    "read": "read_file read_text_file read_media_file read_multiple_files read_note read_email get_file_contents get_issue get_pull_request "
            "get_pull_request_files get_pull_request_status get_pull_request_comments get_pull_request_reviews get-event get_task get_project "
            "get_comment get_label get_section get_filter git_show get_file_info",
    "list": "list_directory list_directory_with_sizes directory_tree list_allowed_directories git_branch git_log list_commits list_issues "
            "list_pull_requests list_notes list-calendars list-events list-colors list_email_labels list_filters get_projects get_tasks "
            "get_labels get_sections get_comments",
    "search": "search_files search_repositories search_code search_issues search_users semantic_search discover_tools search-events search_emails",
    "create": "write_file create_directory git_create_branch create_branch create_repository create_issue create_pull_request add_issue_comment "
              "create_note create-event create-events draft_email create_label get_or_create_label create_filter create_filter_from_template "
              "add_project add_task add_comment add_label add_section fork_repository",
    "write_remote": "create_or_update_file push_files",
    "update": "edit_file update_issue update_note update-event modify_email batch_modify_emails update_label update_task update_comment "
              "update_section batch_update_labels batch_update_tasks update_pull_request_branch",
    "delete": "delete_note delete-event delete_email batch_delete_emails delete_label delete_filter delete_comment delete_section",
    "move": "move_file move_task batch_move_tasks",
    "stage": "git_add", "unstage": "git_reset", "commit": "git_commit", "status": "git_status",
    "diff": "git_diff git_diff_staged git_diff_unstaged", "switch": "git_checkout", "merge": "merge_pull_request",
    "review": "create_pull_request_review", "respond": "respond-to-event", "send": "send_email", "download": "download_attachment",
    "complete": "batch_complete_tasks", "freebusy": "get-freebusy", "time": "get-current-time", "accounts": "manage-accounts",
}
ACT = {t: a for a, ts in ACTION.items() for t in ts.split()}
VERBS = set("read get list search create write update delete move add edit modify draft batch git push fork merge send download "
            "respond or with semantic discover multiple directory allowed".split())


def _words(s: str) -> set[str]:
    return {w.rstrip("s") for w in re.findall(r"[a-z]+", s.lower()) if len(w) > 2}


def _expected(r: dict) -> set[str]:
    e = r["expect"]
    return set() if e is None else {e} if isinstance(e, str) else set(e)


def classify(rows: list[dict], items: list[dict]) -> dict[tuple[str, str], list[dict]]:
    act = lambda t: ACT[t.split("__", 1)[1]]  # noqa: E731
    siblings = collections.defaultdict(set)
    for r in rows:
        if r["expect"] and r.get("group"):
            siblings[r["group"]] |= _expected(r)
    out = collections.defaultdict(list)
    for r, i in zip(rows, items, strict=True):
        e, first = _expected(r), i["first"]
        if not e or first in e:
            continue
        if act(first) in {act(t) for t in e}:
            kind = "same verb, other object"
        else:
            named = _words(first.replace("__", " ").replace("_", " ").replace("-", " ")) - {v.rstrip("s") for v in VERBS}
            sib = first in siblings[r.get("group")] - e
            if sib or first.split("__")[0] in {t.split("__")[0] for t in e} or named & _words(r["text"]):
                kind = "other verb, same noun (sibling)" if sib else "other verb, same noun"
            else:
                kind = "other verb, other noun"
        out[(i["verdict"], kind)].append({"text": r["text"], "expect": sorted(e), "first": first,
                                          "probability": i["probability"], "rank": i.get("rank")})
    return out


def main(argv: list[str]) -> None:
    items = [json.loads(ln) for ln in pathlib.Path(argv[0]).read_text(encoding="utf-8").splitlines() if ln.strip()]
    rows = [json.loads(ln) for ln in (ROOT / "fixtures/labeled/verbs.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip()]
    if [r["text"] for r in rows] != [i["text"] for i in items]:
        sys.exit(f"{argv[0]}: not the --items of fixtures/labeled/verbs.jsonl")
    out = classify(rows, items)
    total = collections.Counter()
    for (verdict, kind), xs in sorted(out.items()):
        total[kind] += len(xs)
        print(f"{verdict:10s} {kind:32s} {len(xs):3d}")
    print("first tool wrong:", sum(total.values()), dict(total))
    if "--list" in argv:
        for (verdict, kind), xs in sorted(out.items()):
            print(f"\n== {verdict}: {kind}")
            for x in xs:
                print(f"  {x['text']!r}: expect {'|'.join(x['expect'])}, first {x['first']} (p {x['probability']:.2f}, rank {x['rank']})")


if __name__ == "__main__":
    main(sys.argv[1:])

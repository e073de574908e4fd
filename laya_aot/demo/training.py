"""The demo model's lesson: synthetic support tickets drawn from a seed, and a short run of laya's trainer.

A demo whose answers are random teaches a newcomer that the tool is broken. The `demo` preset is therefore
trained, when it is made, on tickets generated here from phrase lists (no download, no data file): each
ticket has a team (billing, technical, account), an urgency level and whether the writer is angry, and the
model learns the three questions `laya-aot demo` asks. The demo's own states are not among the tickets.
Training is laya's (`laya.train.items_from_rows`, `laya.train.train_model`) on one CPU thread, so a seed
gives the same weights on one machine (a CPU with other vector instructions rounds differently), in about a
minute on a small CPU.
"""
from __future__ import annotations

import contextlib
import io
import logging
import random
from typing import Any, Dict, List

from .. import progress

log = logging.getLogger(__name__)

# the questions `laya-aot demo` asks and the model is trained on
QUESTIONS: Dict[str, Dict[str, Any]] = {
    "team": {"type": "choice", "instructions": "Which team should handle this message?",
             "criteria": {"billing": "payments, invoices, refunds", "technical": "errors, outages, bugs",
                          "account": "login, password, profile"}},
    "urgency": {"type": "score", "instructions": "How urgent is this message?",
                "criteria": ["not urgent", "somewhat urgent", "urgent", "critical, act now"]},
    "angry": {"type": "noul", "instructions": "The customer is angry."},
}

# what each team's tickets are about: a problem, in a few words
_TOPICS: Dict[str, List[str]] = {
    "billing": [
        "I was charged twice for my subscription", "the invoice for {month} shows the wrong amount",
        "I need a refund for the second payment", "my credit card was billed after I cancelled",
        "the payment for the {month} invoice failed", "please send me a copy of the {month} invoice",
        "you charged me the yearly price instead of the monthly one", "the refund for my order never arrived",
        "why is there an extra fee on my bill", "my invoice lists a plan I never bought",
        "I paid the invoice but it still says unpaid", "the discount was not applied to my payment",
    ],
    "technical": [
        "the service is down", "the app crashes when I open the dashboard", "the website shows a 500 error",
        "the server has been down since {time}", "uploads fail with a timeout error",
        "the page never finishes loading", "the API returns errors for every request",
        "there is an outage in our region", "the export feature is broken after the update",
        "the mobile app freezes on start", "sync stopped working and the data is missing",
        "the system is down and nothing works for the whole team",
    ],
    "account": [
        "please reset my password", "I forgot my password", "I cannot change the email on my profile",
        "my account is locked after too many attempts", "I want to change my username",
        "please delete my account", "the verification code for my login never arrives",
        "how do I update my profile picture", "I need to add a colleague to my account",
        "I want to turn on two-factor authentication", "my profile settings are not saved",
        "I lost access to the phone I use to sign in",
    ],
}
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "September", "October", "November")
_TIMES = ("this morning", "last night", "yesterday", "an hour ago", "noon", "Monday")
_OPENERS = ("", "Hello,", "Hi team,", "Good morning.", "Dear support,", "Hi,")
# urgency level -> phrases that set it
_URGENCY = {
    0: ("no rush, whenever you have time.", "just letting you know.", "it can wait until next week.",
        "thanks in advance."),
    1: ("could you look at it this week?", "please check when you can.", "I would like an answer soon."),
    2: ("please fix it today.", "we need this solved quickly.", "this is blocking my work."),
    3: ("this is critical, please act now!", "everything is stopped, we need help immediately!",
        "urgent: the whole company is affected right now!"),
}
_ANGRY = ("This is unacceptable!", "I am really angry about this.", "I am fed up with your service!",
          "This is the third time and I am furious.", "Terrible service, honestly.")
_CALM = ("Thank you for your help.", "Thanks a lot.", "Have a nice day.", "Kind regards.", "")


def tickets(seed: int, n: int) -> List[Dict[str, Any]]:
    """`n` labelled tickets as laya's trainer reads them: `{state, questions, expected}` rows."""
    rng = random.Random(seed)
    rows = []
    teams = sorted(_TOPICS)
    for i in range(n):
        team = teams[i % len(teams)]
        level = rng.randrange(4)
        angry = rng.random() < 0.4
        topic = rng.choice(_TOPICS[team]).format(month=rng.choice(_MONTHS), time=rng.choice(_TIMES))
        parts = [rng.choice(_OPENERS), topic[0].upper() + topic[1:] + ",", rng.choice(_URGENCY[level]),
                 rng.choice(_ANGRY) if angry else rng.choice(_CALM)]
        rows.append({"state": " ".join(p for p in parts if p), "questions": QUESTIONS,
                     "expected": {"team": team, "urgency": level, "angry": angry}})
    return rows


def train(model, tok, cfg: Dict[str, Any], seed: int, n_tickets: int = 600, epochs: int = 3) -> List[float]:
    """Train `model` in place with laya's trainer on `n_tickets` synthetic tickets; returns each epoch's loss.

    One thread: the result then does not depend on how many cores the machine has. laya's trainer prints
    its epoch losses; they go to the log at INFO.
    """
    import torch
    from laya.train import TrainConfig, items_from_rows, train_model

    items, skipped = items_from_rows(tok, tickets(seed, n_tickets), cfg["max_len"], cfg["head_max_len"])
    if skipped:
        raise RuntimeError("laya's trainer refused demo tickets: %s" % skipped)
    config = TrainConfig(epochs=epochs, micro_batch=16, grad_accum=1, encoder_lr=1e-3, head_lr=1e-3,
                         min_lr=1e-4, loss="soft-ce", seed=seed, amp=False, gradient_checkpointing=False,
                         log_every=0, calib_max=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    printed = io.StringIO()
    try:
        with progress.task("training the demo model on %d synthetic tickets (epochs)" % n_tickets,
                           total=epochs) as line, contextlib.redirect_stdout(printed):
            history = train_model(model, tok, items, config, torch.device("cpu"), cfg["max_len"],
                                  cfg["head_max_len"], on_epoch_end=lambda _epoch, _loss: line.advance())
    finally:
        torch.set_num_threads(threads)
    for line in printed.getvalue().splitlines():
        log.info("demo training: %s", line)
    return history

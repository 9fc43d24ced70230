"""Budgets with holds: admission holds a request's worst case against every budget of
its key and user, under a row lock, and its end gives the hold back (the ledger then carries
what it really cost). So concurrent requests cannot together pass a budget."""

from dataclasses import dataclass
from decimal import Decimal

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from billing.models import Budget, PriceSheet


class OverBudget(Exception):
    pass


PER_PERIOD = {Budget.Period.DAY: "daily", Budget.Period.MONTH: "monthly"}  # not f"{period}ly": "dayly"


@dataclass(frozen=True)
class Hold:
    """What one request holds: the same tokens and money on each of these budgets. Kept as
    JSON in its pending row (to_json/from_json) until its end releases it."""

    budgets: tuple[int, ...] = ()
    tokens: int = 0
    money: Decimal = Decimal(0)

    def to_json(self):
        return {"budgets": list(self.budgets), "tokens": self.tokens, "money": str(self.money)}

    @classmethod
    def from_json(cls, value):
        if not value:  # a row from before holds were kept
            return cls()
        return cls(tuple(value["budgets"]), value["tokens"], Decimal(value["money"]))


def worst_cost(model, prompt_tokens, completion_tokens, now):
    """The most the request can cost at today's prices (no cache discount); 0 when unpriced."""
    sheet = PriceSheet.in_force(model, now)
    if sheet is None:
        return Decimal(0)
    return sheet.costs(prompt_tokens, 0, completion_tokens)["total_cost"]


def hold(api_key_id, user_id, model, prompt_tokens, completion_tokens):
    """Hold the worst case, or raise OverBudget; returns the hold, for `release` at the end.
    Within the caller's transaction where there is one (admission's), without a savepoint of
    its own: an OverBudget rolls all of it back."""
    now = timezone.now()
    tokens = prompt_tokens + completion_tokens
    owners = Q(api_key_id=api_key_id) if api_key_id else Q(pk__in=[])
    if user_id:
        owners |= Q(user_id=user_id)
    with transaction.atomic(savepoint=False):
        budgets = list(Budget.objects.select_for_update().filter(owners).order_by("pk"))
        if not budgets:
            return Hold(tokens=tokens)  # nothing to hold it against, so no price to look up
        money = worst_cost(model, prompt_tokens, completion_tokens, now)
        for budget in budgets:
            check(budget, tokens, money, now)
        for budget in budgets:
            budget.held_tokens += tokens
            budget.held_money += money
            budget.save(update_fields=["held_tokens", "held_money"])
    return Hold(tuple(b.pk for b in budgets), tokens, money)


def check(budget, tokens, money, now):
    spent_tokens, spent_money = budget.spent(now)
    per = PER_PERIOD[budget.period]
    if budget.token_limit is not None and spent_tokens + budget.held_tokens + tokens > budget.token_limit:
        raise OverBudget(
            f"This request could use {tokens} tokens; the {per} budget of {budget.token_limit} has {budget.token_limit - spent_tokens - budget.held_tokens} left."
        )
    if budget.money_limit is not None and spent_money + budget.held_money + money > budget.money_limit:
        raise OverBudget(f"This request could cost {money}; the {per} budget of {budget.money_limit} does not have that left.")


def release(held):
    """The request ended (its ledger entry is written): give its hold back."""
    if not held.budgets:
        return
    with transaction.atomic():
        for budget in Budget.objects.select_for_update().filter(pk__in=held.budgets).order_by("pk"):
            budget.held_tokens = max(budget.held_tokens - held.tokens, 0)
            budget.held_money = max(budget.held_money - held.money, Decimal(0))
            budget.save(update_fields=["held_tokens", "held_money"])

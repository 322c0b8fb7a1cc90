"""Closed-form results of queueing theory that the simulator is checked against."""

from __future__ import annotations

import math


def erlang_c(c: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a = lambda/mu (< c)."""
    rho = offered / c
    top = offered**c / math.factorial(c) / (1 - rho)
    return top / (sum(offered**k / math.factorial(k) for k in range(c)) + top)


def mmc_mean_wait(lam: float, mu: float, c: int) -> float:
    """Mean time in queue (before service) of M/M/c."""
    return erlang_c(c, lam / mu) / (c * mu - lam)


def mm1_sojourn_quantile(lam: float, mu: float, q: float) -> float:
    """M/M/1 FCFS sojourn time is exponential with rate mu - lambda."""
    return -math.log(1 - q) / (mu - lam)


def mmck_blocking(lam: float, mu: float, c: int, k: int) -> float:
    """Probability that an arrival finds an M/M/c/K system full (K = servers + waiting places)."""
    a = lam / mu
    weights = [
        a**n / math.factorial(n) if n <= c else a**n / (math.factorial(c) * c ** (n - c))
        for n in range(k + 1)
    ]
    return weights[k] / sum(weights)


def md1_mean_wait(lam: float, service: float) -> float:
    """Pollaczek-Khinchine: mean wait of M/D/1 = rho * D / (2 (1 - rho))."""
    rho = lam * service
    return rho * service / (2 * (1 - rho))


def mm1_mean_wait_variance(lam: float, mu: float, n: int) -> float:
    """Asymptotic variance of the sample mean of n successive M/M/1 waiting times (autocorrelation included).

    Daley (1968) / Whitt (1989): n * Var(mean W_q) -> rho (2 + 5 rho - 4 rho^2 + rho^3) / (mu^2 (1 - rho)^4).
    """
    rho = lam / mu
    return rho * (2 + 5 * rho - 4 * rho**2 + rho**3) / (mu**2 * (1 - rho) ** 4) / n

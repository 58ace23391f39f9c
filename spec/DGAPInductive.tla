---------------------------- MODULE DGAPInductive ----------------------------
(***************************************************************************)
(* An inductive-invariant check of DGAP's per-rank safety core.            *)
(*                                                                         *)
(* IndInv conjoins TypeOK, NoLoss (hence NoDuplicate), BudgetSafety,       *)
(* IdentityCoverage, PadsOnlyAtEnd, ExactLossScaling and the facts they    *)
(* rest on.  TLC starts from EVERY state of a bounded type domain that     *)
(* satisfies IndInv (not only reachable ones) and takes one step of Next:  *)
(* a violation of IndInv in a successor would mean IndInv /\ Next =>       *)
(* IndInv' fails.  Each rank's gathered vector may hold any offer of the   *)
(* others within the domain, so Receive is checked against every decision  *)
(* those offers can produce.  The cross-rank invariants (StepAlignment,    *)
(* CollectiveAlignment, TerminationAgreement, QuotaClosure, WindowAlignment,*)
(* the bounds) are checked on reachable states by the MC models; proofs/   *)
(* argues them.                                                            *)
(***************************************************************************)
EXTENDS DGAP

CONSTANTS
    MaxCount,  \* bound of emitted in the domain
    Drop       \* "" or "done-is-empty": a conjunct left out, to show it is needed

VARIABLE depth      \* 0 in the initial states, 1 after the one step taken

Owned(r) == pending[r] \cup buffer[r] \cup UNION {ready[r][t] : t \in DOMAIN ready[r]}

\* Sequences of at most two nonempty batches of one rank's ids.
BatchSeqs(S) ==
    LET B == (SUBSET S) \ {{}}
    IN {<<>>} \cup {<<b>> : b \in B} \cup {<<b, c>> : b, c \in B}

\* Every vector rank s can send: its batches are sets of its own samples.
Offers(s) ==
    {[offered |-> 0, final |-> f, samples |-> <<>>, tokens |-> <<>>, loss_tokens |-> <<>>] :
        f \in BOOLEAN}
    \cup
    {[offered |-> 1, final |-> f, samples |-> <<Cardinality(b)>>, tokens |-> <<Tokens(b)>>,
      loss_tokens |-> <<LossTokens(b)>>] :
        f \in BOOLEAN, b \in (SUBSET Shard[s]) \ {{}}}

\* A waiting rank's gathered round: its own vector and any offers of the others.
InboxChoices(r) ==
    {NoValue} \cup
    IF contribution[r] = NoValue THEN {}
    ELSE {[s \in Ranks |-> IF s = r THEN contribution[r] ELSE o[s]] :
            o \in [Ranks \ {r} -> UNION {Offers(s) : s \in Ranks \ {r}}]}

\* What OfferMatches and ExactLossScaling leave open of a vector: whether it is final.
ContributionChoices(r) == {NoValue} \cup {[Offer(r) EXCEPT !.final = f] : f \in BOOLEAN}

OfferMatches ==
    \A r \in Ranks :
        /\ (phase[r] = "waiting") = (contribution[r] # NoValue)
        /\ contribution[r] # NoValue =>
            LET c == contribution[r]
            IN /\ c.offered = Min2(Len(ready[r]), M)
               /\ c.final => exhausted[r] /\ buffer[r] = {} /\ Len(ready[r]) <= M

\* A finished rank holds nothing.  Without it IndInv is not inductive: a rank
\* could be done with samples still in its source (MCInductive_weak_bug).
DoneIsEmpty ==
    Drop = "done-is-empty" \/ \A r \in Ranks : phase[r] = "done" => Owned(r) = {}

IndInv ==
    /\ TypeOK
    /\ \A r \in Ranks : Owned(r) \subseteq Shard[r]
    /\ \A r \in Ranks : exhausted[r] => pending[r] = {}
    /\ DoneIsEmpty
    /\ NoLoss
    /\ NoDuplicate
    /\ BudgetSafety
    /\ OfferMatches
    /\ \A r \in Ranks : inbox[r] # NoValue => phase[r] = "waiting"
    /\ ExactLossScaling
    /\ IdentityCoverage
    /\ PadsOnlyAtEnd

\* Every IndInv state of the domain, enumerated so that TLC prunes early.  The
\* counters round and steps are fixed (0, and pads at most 1), and so is the
\* optimizer-window state (window_loss, window_local, windows: nothing open,
\* nothing closed): no guard or update of an IndInv variable reads them;
\* emitted, read by the quota cut only, ranges over 0 .. MaxCount.  This
\* module is for two ranks.
IndInit ==
    /\ depth = 0
    /\ pending \in [Ranks -> SUBSET Ids]
    /\ \A r \in Ranks : pending[r] \subseteq Shard[r]
    /\ buffer \in [Ranks -> SUBSET Ids]
    /\ \A r \in Ranks : buffer[r] \subseteq Shard[r] \ pending[r] /\ Cardinality(buffer[r]) <= K
    /\ ready \in [Ranks -> BatchSeqs(Ids)]
    /\ \A r \in Ranks : Owned(r) \subseteq Shard[r]
    /\ delivered \in [Ids -> 0 .. 1]
    /\ ledger \in SUBSET Ids
    /\ NoLoss
    /\ BudgetSafety
    /\ exhausted \in [Ranks -> BOOLEAN]
    /\ \A r \in Ranks : exhausted[r] => pending[r] = {}
    /\ phase \in [Ranks -> Phases]
    /\ DoneIsEmpty
    /\ round = [r \in Ranks |-> 0]
    /\ pads \in [Ranks -> 0 .. 1]
    /\ steps = pads
    /\ PadsOnlyAtEnd
    /\ window_loss = [r \in Ranks |-> 0]
    /\ window_local = [r \in Ranks |-> 0]
    /\ windows = [r \in Ranks |-> <<>>]
    /\ emitted \in [Ranks -> 0 .. MaxCount]
    /\ \E c0 \in ContributionChoices(0), c1 \in ContributionChoices(1) :
            contribution = [r \in Ranks |-> IF r = 0 THEN c0 ELSE c1]
    /\ OfferMatches
    /\ \E i0 \in InboxChoices(0), i1 \in InboxChoices(1) :
            inbox = [r \in Ranks |-> IF r = 0 THEN i0 ELSE i1]
    /\ IndInv

IndNext == depth = 0 /\ Next /\ depth' = 1

=============================================================================

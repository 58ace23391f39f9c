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
    Drop       \* "", "done-is-empty" or "all-hold": a conjunct left out, to show it is needed

VARIABLE depth      \* 0 in the initial states, 1 after the one step taken

Owned(r) == pending[r] \cup buffer[r] \cup UNION {ready[r][t] : t \in DOMAIN ready[r]}

\* Sequences of at most two nonempty batches of one rank's ids.
BatchSeqs(S) ==
    LET B == (SUBSET S) \ {{}}
    IN {<<>>} \cup {<<b>> : b \in B} \cup {<<b, c>> : b, c \in B}

\* Every vector rank s can send: its batches are sets of its own samples.
Offers(s) ==
    {[offered |-> 0, final |-> f, samples |-> <<>>, tokens |-> <<>>, loss_tokens |-> <<>>,
      unread |-> 0, held |-> 0, held_work |-> 0] :
        f \in BOOLEAN}
    \cup
    {[offered |-> 1, final |-> f, samples |-> <<Cardinality(b)>>, tokens |-> <<Tokens(b)>>,
      loss_tokens |-> <<LossTokens(b)>>, unread |-> 0, held |-> 0, held_work |-> 0] :
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
    /\ OfferExact
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
    /\ step_batches = [r \in Ranks |-> [t \in 1 .. steps[r] |-> {}]]
    /\ step_counts = [r \in Ranks |-> [t \in 1 .. steps[r] |-> <<0, 0, 0>>]]
    /\ PadsOnlyAtEnd
    /\ window_loss = [r \in Ranks |-> 0]
    /\ window_local = [r \in Ranks |-> 0]
    /\ windows = [r \in Ranks |-> <<>>]
    /\ cursor = [r \in Ranks |-> 0]
    /\ formed = [r \in Ranks |-> FALSE]
    /\ placement = NoValue
    /\ emitted \in [Ranks -> 0 .. MaxCount]
    /\ \E c0 \in ContributionChoices(0), c1 \in ContributionChoices(1) :
            contribution = [r \in Ranks |-> IF r = 0 THEN c0 ELSE c1]
    /\ OfferMatches
    /\ \E i0 \in InboxChoices(0), i1 \in InboxChoices(1) :
            inbox = [r \in Ranks |-> IF r = 0 THEN i0 ELSE i1]
    /\ IndInv

IndNext == depth = 0 /\ Next /\ depth' = 1

-----------------------------------------------------------------------------
(* The cross-rank part: Align of proofs/step_alignment.md, the termination  *)
(* agreement and the quota closure, on top of IndInv, with M >= 2.         *)
(* CrossInit adds rounds, step and emitted counts to IndInit's domain; the  *)
(* other rank's entry of a gathered round ranges over Offers2 (up to two    *)
(* batches).                                                                *)

\* Vectors of up to two batches of rank s's ids.
Offers2(s) ==
    Offers(s) \cup
    {[offered |-> 2, final |-> f, samples |-> <<Cardinality(b), Cardinality(c)>>,
      tokens |-> <<Tokens(b), Tokens(c)>>, loss_tokens |-> <<LossTokens(b), LossTokens(c)>>,
      unread |-> 0, held |-> 0, held_work |-> 0] :
        f \in BOOLEAN, b, c \in (SUBSET Shard[s]) \ {{}}}

Top == MaxOf({round[r] : r \in Ranks})
Lag == {s \in Ranks : round[s] < Top}
Dec(s) == Decide(inbox[s], emitted[s])
IsDone(r) == phase[r] = "done"
\* Samples rank s emits when it consumes its gathered round.
Due(s) == SumOver(1 .. Min2(Dec(s).steps, Len(ready[s])),
                  [t \in 1 .. Min2(Dec(s).steps, Len(ready[s])) |-> Cardinality(ready[s][t])])
DeliveredCount == Cardinality({i \in Ids : delivered[i] = 1})
\* Every id of rank s's shard is delivered, or is in a batch s runs when it
\* consumes its gathered round: s is (or is about to be) the rank that ran dry.
Dry(s) ==
    \A i \in Shard[s] :
        \/ delivered[i] = 1
        \/ s \in Lag /\ \E t \in 1 .. Min2(Dec(s).steps, Len(ready[s])) : i \in ready[s][t]

Align ==
    /\ CollectiveAlignment                                                        \* A1
    /\ \A s \in Lag : inbox[s] # NoValue                                          \* A2
    /\ Lag # {} => \A r \in Ranks \ Lag : inbox[r] = NoValue                      \* A3
    /\ \A r, s \in Ranks : inbox[r] # NoValue /\ inbox[s] # NoValue =>
            inbox[r] = inbox[s]                                                   \* A4
    /\ \A r, s \in Ranks : round[r] = round[s] =>
            steps[r] = steps[s] /\ emitted[r] = emitted[s] /\ IsDone(r) = IsDone(s) \* A5
    /\ \A r \in Ranks \ Lag, s \in Lag :
            /\ steps[r] = steps[s] + Dec(s).steps
            /\ emitted[r] = emitted[s] + SumSeq(Dec(s).global_samples)
            /\ IsDone(r) = Dec(s).done                                            \* A6
    /\ Drop = "all-hold" \/
       ((Lag = {} /\ \E s \in Ranks : inbox[s] # NoValue) =>
            \A r \in Ranks : inbox[r] # NoValue)                                  \* A8
    \* What the ranks emitted adds up: the delivered samples, and those the
    \* lagging ranks emit when they consume the round.
    /\ \A r \in Ranks \ Lag :
            emitted[r] = DeliveredCount + SumOver(Lag, [s \in Lag |-> Due(s)])
    \* A closed quota epoch met its quota, or a rank ran dry.
    /\ Mode = "quota" =>
        \A r \in Ranks : IsDone(r) =>
            (Quota > 0 /\ emitted[r] >= Quota) \/ \E s \in Ranks : Dry(s)

CrossInv ==
    /\ IndInv
    /\ Align
    /\ StepAlignment
    /\ CollectiveAlignment
    /\ TerminationAgreement
    /\ QuotaClosed
    /\ \A i \in ledger : \E r \in Ranks : IsDone(r) /\ i \in Shard[r]

\* The lagging rank (two ranks: at most one lags) and the counts that follow
\* from its emitted count e and its step count n by A5/A6.
LagRank == CHOOSE s \in Lag : TRUE
EmittedFrom(e) ==
    IF Lag = {} THEN [r \in Ranks |-> e]
    ELSE [r \in Ranks |->
            IF r \in Lag THEN e
            ELSE e + SumSeq(Decide(inbox[LagRank], e).global_samples)]
StepsFrom(n) ==
    IF Lag = {} THEN [r \in Ranks |-> n]
    ELSE [r \in Ranks |->
            IF r \in Lag THEN n ELSE n + Decide(inbox[LagRank], emitted[LagRank]).steps]

\* Every CrossInv state of the domain, for two ranks: IndInit's per-rank
\* domain, rounds 0 .. 1, any gathered rounds, the laggard's emitted count in
\* 0 .. MaxCount and step count in 0 .. 1, pads 0 .. 1; no optimizer windows.
\* The cheap conjuncts of Align come right after the variables they read, so
\* that TLC prunes early.
CrossInit ==
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
    /\ \A i \in ledger : \E r \in Ranks : IsDone(r) /\ i \in Shard[r]
    /\ round \in [Ranks -> 0 .. 1]
    /\ 0 \in {round[r] : r \in Ranks}
    /\ \A r, s \in Ranks : round[r] = round[s] => IsDone(r) = IsDone(s)
    /\ \E c0 \in ContributionChoices(0), c1 \in ContributionChoices(1) :
            contribution = [r \in Ranks |-> IF r = 0 THEN c0 ELSE c1]
    /\ OfferMatches
    \* The holders H of the one gathered round g (A4): the laggards (A2, A3),
    \* or, with none lagging, nobody or everybody (A8).  g holds the holders'
    \* own vectors (A7) and any vector of the others.
    /\ \E H \in SUBSET Ranks :
        /\ Lag # {} => H = Lag
        /\ Drop = "all-hold" \/ Lag # {} \/ H \in {{}, Ranks}
        /\ \A r \in H : contribution[r] # NoValue
        /\ \E o \in IF H = {} THEN {<<>>}
                   ELSE [Ranks \ H -> UNION {Offers2(x) : x \in Ranks \ H}] :
             /\ H # {} => \A x \in Ranks \ H : o[x] \in Offers2(x)
             /\ inbox = [r \in Ranks |->
                    IF r \in H THEN [x \in Ranks |-> IF x \in H THEN contribution[x] ELSE o[x]]
                    ELSE NoValue]
    /\ \E e \in 0 .. MaxCount : emitted = EmittedFrom(e)
    /\ \A r \in Ranks \ Lag :
            emitted[r] = DeliveredCount + SumOver(Lag, [s \in Lag |-> Due(s)])
    /\ \E n \in 0 .. 1 : steps = StepsFrom(n)
    /\ pads \in [Ranks -> 0 .. 1]
    /\ \A r \in Ranks : pads[r] <= steps[r]
    /\ step_batches = [r \in Ranks |->
            [t \in 1 .. steps[r] |-> IF t <= steps[r] - pads[r] THEN {0} ELSE {}]]
    /\ step_counts = [r \in Ranks |-> [t \in 1 .. steps[r] |-> <<0, 0, 0>>]]
    /\ PadsOnlyAtEnd
    /\ window_loss = [r \in Ranks |-> 0]
    /\ window_local = [r \in Ranks |-> 0]
    /\ windows = [r \in Ranks |-> <<>>]
    /\ cursor = [r \in Ranks |-> 0]
    /\ formed = [r \in Ranks |-> FALSE]
    /\ placement = NoValue
    /\ CrossInv

=============================================================================

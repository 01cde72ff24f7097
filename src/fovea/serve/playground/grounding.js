// The grounding line of fovea's playground: what an answer's grounding score means, and how loud
// to say it. No DOM here: the page loads it before app.js, and the tests run it in node.
"use strict";

// g: the stream's fovea.grounding; canaryFailed: /health says the grounding canary failed.
// The page does not know the right answer, so "not image-dependent" is not a failure by itself:
// a blank image giving the same first words is what the score measures (a count of one shape is
// often answered the same without it). Red is kept for a model the canary finds ignoring images.
function groundingLine(g, canaryFailed) {
  if (!g || g.image_dependent === null || g.image_dependent === undefined) {
    return { text: (g && g.note) || "not scored", className: "" };
  }
  if (g.image_dependent) return { text: "yes", className: "ok" };
  if (canaryFailed) {
    return { text: "NO: the answer did not depend on the image, and the canary says this model ignores images",
             className: "bad" };
  }
  return { text: "the same answer would come without the picture (a blank image gives the same first words)",
           className: "neutral" };
}

if (typeof module !== "undefined") module.exports = { groundingLine };
